# Held contexts (docs/lab.md): the squeeze, with llmsd holding what its apps built before the
# run — 8 conversations of thousands of tokens each on flash (`llms lab prebuild` on the host;
# TCG prefills far too slowly to build them here), which the calls switch back in until the KV
# budget is full. What pressure-following is worth: the memory llmsd can give back when the
# pressure process asks. llmsd and fixed-budget only (the status quo would have to recompute
# every conversation under TCG). Short prompts and 4 decoded tokens a call: each token reads
# its whole context.
# The pressure comes in bursts (a camera or a game opened and closed): three times 75% of
# memory for 15 s, 15 s apart, so the budget has to follow it down and back up each time.
# Args: SYSTEM [HOG_PLAN]
BUDGET=96MiB
TRACE=/lab/trace-held.jsonl
DRIVE_FLAGS="--adopt --max-tokens 4"
TOML='max_context_tokens = 8192'
. /lab/squeeze.sh "$1" "${2:-0:0,15:75%,30:0,45:75%,60:0,75:75%,90:0}" held
