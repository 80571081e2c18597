# Runs its arguments as one command in the guest (a developer's probe: `tools/lab/lab.sh run cmd
# llms doctor`); its output is /out/scenario.log.
set -u
"$@"
