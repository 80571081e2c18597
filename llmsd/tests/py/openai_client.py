"""llmsd's HTTP front driven by the real `openai` and `prometheus_client` packages.

Run by llmsd/tests/http.rs against a live llmsd (levels = ["int8"]: no lossy compression, so
a continued context's greedy output can be compared with a fresh context's):

    openai_client.py main    HTTP_SOCKET TCP_URL TOKEN_A TOKEN_B STATE_JSON
    openai_client.py restart HTTP_SOCKET TCP_URL TOKEN_A TOKEN_B STATE_JSON

`main` runs every check and leaves a conversation in STATE_JSON; `restart` (after the service
was restarted) continues it. Exit status 0 and "ok N checks" when every check held.
"""

import json
import sys
import threading

import httpx
import openai
from prometheus_client.openmetrics.parser import text_string_to_metric_families

PHASE, SOCK, TCP, TOKEN_A, TOKEN_B, STATE = sys.argv[1:7]
CHECKS = 0


def check(cond, what):
    global CHECKS
    CHECKS += 1
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)


def transport():
    return httpx.HTTPTransport(uds=SOCK)


def unix_client(app):
    return openai.OpenAI(
        base_url="http://llmsd/v1",
        api_key="unused-on-the-unix-socket",
        http_client=httpx.Client(transport=transport(), timeout=300),
        default_headers={"X-LLMS-App": app},
        max_retries=0,
    )


def raw(method, path, **kw):
    with httpx.Client(transport=transport(), base_url="http://llmsd", timeout=300) as c:
        return c.request(method, path, **kw)


def chat(c, msgs, max_tokens=24, **kw):
    r = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, temperature=0, max_tokens=max_tokens, **kw)
    return r.parse(), r.headers.get("x-llms-context"), r.headers.get("x-llms-context-match")


def expect_error(exc, status, code, f):
    try:
        f()
    except exc as e:
        check(e.status_code == status, f"status {e.status_code}, want {status}: {e}")
        check(e.code == code, f"code {e.code!r}, want {code!r}: {e}")
        return e
    check(False, f"no error, want {status} {code}")


SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}
MODEL = unix_client("probe").models.list().data[0].id

if PHASE == "main":
    a = unix_client("py-a")
    # 1. A new conversation, not streamed.
    msgs = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    r1, ctx, how = chat(a, msgs)
    a1 = r1.choices[0].message.content
    check(r1.object == "chat.completion" and a1, f"an answer: {r1}")
    check(how == "new" and ctx and len(ctx) == 32, f"a new context is named: {how} {ctx}")
    check(r1.usage.prompt_tokens > 0 and r1.usage.prompt_tokens_details.cached_tokens == 0, f"usage of a new context: {r1.usage}")
    check(r1.choices[0].finish_reason in ("stop", "length"), r1.choices[0].finish_reason)

    # 2. Continued: only the new turn is prefilled; the output equals a fresh context's.
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And of Italy?"}]
    r2, ctx2, how2 = chat(a, msgs)
    history = r1.usage.prompt_tokens + r1.usage.completion_tokens
    check(ctx2 == ctx and how2 == "continued", f"the same context continues: {ctx2} {how2}")
    check(r2.usage.prompt_tokens_details.cached_tokens == history, f"cached_tokens {r2.usage.prompt_tokens_details.cached_tokens} = the history {history}")
    fresh, fctx, fhow = chat(unix_client("py-fresh"), msgs)
    check(fhow == "new" and fctx != ctx and fresh.usage.prompt_tokens_details.cached_tokens == 0, f"a fresh context: {fhow}")
    check(fresh.choices[0].message.content == r2.choices[0].message.content,
          f"continued == fresh: {r2.choices[0].message.content!r} vs {fresh.choices[0].message.content!r}")
    check(fresh.usage.prompt_tokens == r2.usage.prompt_tokens, f"same prompt length: {fresh.usage} {r2.usage}")

    # 3. Streamed, with usage: the same text as the answer in one piece.
    s = unix_client("py-stream").chat.completions.create(
        model=MODEL, messages=msgs[:2], temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True})
    chunks = list(s)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    check(chunks[0].choices[0].delta.role == "assistant", "the first chunk names the role")
    check(len(pieces) > 1 and "".join(pieces) == a1, f"streamed pieces make the answer: {pieces} vs {a1!r}")
    check(any(c.choices and c.choices[0].finish_reason for c in chunks), "a finish reason")
    check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r1.usage.completion_tokens, f"usage last: {chunks[-1]}")

    # 4. /v1/completions.
    t = a.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    check(t.object == "text_completion" and t.choices[0].text, f"a completion: {t}")

    # 4b. The sampling parameters, as the client sends them. Each call from an app of its own
    # (a fresh context), so no answer continues another.
    q = [{"role": "user", "content": "What is the capital of France?"}]
    fresh_app = iter(range(1000))
    def ask(**kw):
        kw.setdefault("max_tokens", 24)
        return unix_client(f"py-p{next(fresh_app)}").chat.completions.create(model=MODEL, messages=q, **kw)
    greedy = ask(temperature=0)
    g = greedy.choices[0].message.content
    check(len(g.split()) > 2, f"a greedy answer of some words: {g!r}")
    # stop: the answer ends before the first stop string, reason "stop".
    cut = g.split()[2]
    r = ask(temperature=0, stop=[cut, "never-said"])
    check(r.choices[0].message.content == g[:g.index(cut)] and r.choices[0].finish_reason == "stop",
          f"stop at {cut!r}: {r.choices[0].message.content!r} of {g!r}, {r.choices[0].finish_reason}")
    # max_tokens and max_completion_tokens: exactly that many, reason "length".
    r = ask(temperature=0, max_tokens=3)
    check(r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length", f"max_tokens 3: {r.usage} {r.choices[0]}")
    r = unix_client("py-mct").chat.completions.create(model=MODEL, messages=q, temperature=0, max_completion_tokens=2)
    check(r.usage.completion_tokens == 2, f"max_completion_tokens 2: {r.usage}")
    e = expect_error(openai.BadRequestError, 400, "invalid_request", lambda: ask(max_tokens=10**9))
    check("at most" in e.message, f"the limit is named: {e.message}")
    # seed: the same seed samples the same answer; different seeds do not all agree.
    hot = dict(temperature=1.2, top_p=1.0, max_tokens=24)
    a7, b7 = ask(seed=7, **hot).choices[0].message.content, ask(seed=7, **hot).choices[0].message.content
    check(a7 == b7, f"seed 7 twice: {a7!r} vs {b7!r}")
    others = {ask(seed=s, **hot).choices[0].message.content for s in (8, 9, 10)}
    check(len(others | {a7}) > 1, f"four seeds at temperature 1.2 all gave {a7!r}")
    # temperature 0 is greedy; top_p that keeps only the likeliest token is greedy at any temperature.
    check(ask(temperature=1.5, top_p=1e-9, seed=3).choices[0].message.content == g, "top_p ~0 keeps the likeliest token")
    # Fields not implemented are refused by name (or accepted at a neutral value).
    for field, value in [("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
                         ("response_format", {"type": "json_object"}), ("logit_bias", {"1": 5}), ("n", 2),
                         ("logprobs", True), ("frequency_penalty", 0.5), ("made_up_field", 1)]:
        e = expect_error(openai.BadRequestError, 400, "unsupported_parameter", lambda: ask(temperature=0, extra_body={field: value}))
        check(e.param == field, f"{field}: the error names it: {e.param!r} {e.message}")
    r = ask(temperature=0, extra_body={"frequency_penalty": 0, "tool_choice": "none", "user": "u1", "n": 1, "logprobs": False})
    check(r.choices[0].message.content == g, "neutral values change nothing")

    # 5. Errors: OpenAI's error object with the right status.
    r = raw("POST", "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    check(r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", f"bad JSON: {r.status_code} {r.text}")
    r = raw("POST", "/v1/chat/completions", json={"model": MODEL, "messages": []})
    check(r.status_code == 400 and "user message" in r.json()["error"]["message"], f"no messages: {r.text}")
    r = raw("GET", "/v1/nothing")
    check(r.status_code == 404 and "error" in r.json(), f"unknown endpoint: {r.text}")
    expect_error(openai.NotFoundError, 404, "model_not_found",
                 lambda: a.chat.completions.create(model="gpt-9", messages=msgs[:2], max_tokens=4))
    long = [{"role": "user", "content": "tell me " * 600}]
    expect_error(openai.BadRequestError, 400, "context_length_exceeded",
                 lambda: a.chat.completions.create(model=MODEL, messages=long, max_tokens=4))
    # Another app's context and no context at all: the same answer.
    b = unix_client("py-b")
    e1 = expect_error(openai.NotFoundError, 404, "context_not_found",
                      lambda: b.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_headers={"X-LLMS-Context": ctx}))
    e2 = expect_error(openai.NotFoundError, 404, "context_not_found",
                      lambda: b.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_headers={"X-LLMS-Context": "0" * 32}))
    check(e1.message.replace(ctx, "X") == e2.message.replace("0" * 32, "X"), f"same words: {e1.message} / {e2.message}")
    # Pinned by its owner: it continues.
    r3, ctx3, _ = chat(a, msgs + [{"role": "assistant", "content": r2.choices[0].message.content}, {"role": "user", "content": "And of Spain?"}],
                       extra_headers={"X-LLMS-Context": ctx})
    check(ctx3 == ctx, "a pinned context continues")
    msgs += [{"role": "assistant", "content": r2.choices[0].message.content}, {"role": "user", "content": "And of Spain?"},
             {"role": "assistant", "content": r3.choices[0].message.content}]

    # TCP: bearer tokens.
    tcp = lambda key: openai.OpenAI(base_url=TCP + "/v1", api_key=key, max_retries=0, timeout=300)
    expect_error(openai.AuthenticationError, 401, "invalid_api_key", lambda: tcp("not-a-token-at-all").models.list())
    r = httpx.post(TCP + "/v1/chat/completions", json={"model": MODEL, "messages": msgs[:2]}, timeout=60)
    check(r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", f"no token: {r.status_code} {r.text}")
    tr = tcp(TOKEN_A).chat.completions.with_raw_response.create(model=MODEL, messages=msgs[:2], temperature=0, max_tokens=24)
    tctx = tr.headers.get("x-llms-context")
    check(tr.parse().choices[0].message.content == a1, "the TCP app gets the same answer")
    expect_error(openai.NotFoundError, 404, "context_not_found",
                 lambda: tcp(TOKEN_B).chat.completions.create(model=MODEL, messages=msgs[:2], max_tokens=4, extra_headers={"X-LLMS-Context": tctx}))
    expect_error(openai.NotFoundError, 404, "context_not_found",
                 lambda: a.chat.completions.create(model=MODEL, messages=msgs[:2], max_tokens=4, extra_headers={"X-LLMS-Context": tctx}))

    # 6. Two conversations interleaved under a budget that evicts: each continues its own.
    c = unix_client("py-i")
    convs = [[{"role": "system", "content": s}] for s in ("You like the sea.", "You like mountains.")]
    ids, hist = [None, None], [0, 0]
    for turn, q in enumerate(["Name a colour.", "Why?", "Say more."]):
        for k in range(2):
            convs[k].append({"role": "user", "content": q})
            r, cid, how = chat(c, convs[k])
            if turn == 0:
                ids[k] = cid
                check(r.usage.prompt_tokens_details.cached_tokens == 0, "first turn: nothing cached")
            else:
                check(cid == ids[k] and how == "continued", f"conversation {k} turn {turn}: {cid} {how}")
                check(r.usage.prompt_tokens_details.cached_tokens == hist[k], f"turn {turn}: cached {r.usage.prompt_tokens_details.cached_tokens} want {hist[k]}")
            convs[k].append({"role": "assistant", "content": r.choices[0].message.content})
            hist[k] = r.usage.prompt_tokens + r.usage.completion_tokens
    check(ids[0] != ids[1], "two contexts")

    # 7. A full queue: 429 with Retry-After (max_queue = 2 in the test's configuration).
    errs, oks = [], []
    def one(i):
        try:
            unix_client(f"py-q{i}").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {i + 20}."}], temperature=0, max_tokens=60)
            oks.append(i)
        except openai.RateLimitError as e:
            errs.append(e)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    check(errs and oks, f"some refused, some served: {len(errs)} / {len(oks)}")
    check(all(e.status_code == 429 and e.response.headers.get("retry-after") for e in errs), "429 with Retry-After")

    # 8. Prometheus.
    text = raw("GET", "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ["llms_calls", "llms_switch_latency_seconds", "llms_ttft_seconds", "llms_kv_resident_bytes", "llms_kv_budget_bytes",
                 "llms_flash_bytes", "llms_evicted_chunks", "llms_aot_writes", "llms_faults", "llms_read_chunks", "llms_recomputed_chunks",
                 "llms_pressure_level", "llms_contexts_per_app", "llms_queue_depth", "llms_http_requests", "llms_decode_tokens_per_second",
                 "llms_cached_tokens"]:
        check(name in fams, f"metric {name} in {sorted(fams)}")
    val = lambda n: sum(s.value for s in fams[n].samples if s.name.endswith("_total") or s.name == n)
    check(val("llms_evicted_chunks") > 0, "the small budget evicted chunks")
    check(val("llms_read_chunks") + val("llms_recomputed_chunks") > 0, "evicted contexts came back (read or recomputed)")
    statuses = {s.labels["status"] for s in fams["llms_http_requests"].samples}
    check({"200", "400", "401", "404", "429"} <= statuses, f"requests by status: {statuses}")
    check(all("ctx" not in s.labels for f in fams.values() for s in f.samples), "no context ids as labels")

    # 7. A branch (an earlier message edited) takes what it shares with the conversation it
    #    leaves (prefix sharing): only the rest is prefilled, and it answers
    #    as a fresh context of another app, which shares nothing, does.
    b = unix_client("py-branch")
    conv = [{"role": "system", "content": "You are a helpful assistant who knows the rivers of Europe well. " * 3},
            {"role": "user", "content": "Name a river in France."}]
    r, bctx, _ = chat(b, conv, max_tokens=8)
    conv += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "And in Spain?"}]
    chat(b, conv, max_tokens=8)
    edited = conv[:-1] + [{"role": "user", "content": "And in Italy?"}]
    rb, bctx2, bhow = chat(b, edited, max_tokens=8)
    cached = rb.usage.prompt_tokens_details.cached_tokens
    check(bhow == "branched" and bctx2 != bctx, f"an edited message branches: {bhow}")
    # The conversation's whole chunks, then the rows of its next chunk up to the edit (copied:
    # "And in" is 11 tokens past a chunk's end here): only the edited words are prefilled.
    check(cached >= 48 and cached % 16 != 0 and rb.usage.prompt_tokens - cached < 16,
          f"the branch prefilled only from the edit on: {rb.usage}")
    fresh, _, _ = chat(unix_client("py-branch-fresh"), edited, max_tokens=8)
    check(fresh.usage.prompt_tokens_details.cached_tokens == 0, f"another app shares nothing: {fresh.usage}")
    check(fresh.choices[0].message.content == rb.choices[0].message.content,
          f"branch == fresh: {rb.choices[0].message.content!r} vs {fresh.choices[0].message.content!r}")

    json.dump({"ctx": ctx, "msgs": msgs + [{"role": "user", "content": "And of Portugal?"}], "app": "py-a"}, open(STATE, "w"))
elif PHASE == "restart":
    st = json.load(open(STATE))
    r, cid, how = chat(unix_client(st["app"]), st["msgs"])
    check(cid == st["ctx"] and how == "continued", f"after a restart the same context continues: {cid} {how}")
    check(r.usage.prompt_tokens_details.cached_tokens > 0 and r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens < 16,
          f"only the new turn is prefilled: {r.usage}")
else:
    sys.exit(f"unknown phase {PHASE}")
print(f"ok {CHECKS} checks", flush=True)
