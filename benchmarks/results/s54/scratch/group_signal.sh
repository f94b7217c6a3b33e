# From the repository root: SIG=TERM|INT bash benchmarks/results/s54/scratch/group_signal.sh
# Starts `prefixserve serve` (the embedded default model) in a session of its own with SIGINT at its default (as a
# terminal's foreground job has it), waits until it serves, sends SIG to the whole process group (SIGINT: Ctrl-C at a
# terminal; SIGTERM: systemd's default stop), and prints how long the CLI took to exit and what is left 2 s later.
LOG=/tmp/group_signal.log
DEFAULT_SIGINT="import os, signal as s, sys; s.signal(s.SIGINT, s.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
setsid python3 -c "$DEFAULT_SIGINT" .venv/bin/prefixserve serve --port 8412 > "$LOG" 2>&1 &
PID=$!
for i in $(seq 1 90); do sleep 2; grep -q "prefixserve: serving" "$LOG" && break; done
PGID=$(ps -o pgid= -p $PID | tr -d ' ')
T0=$(date +%s.%N); kill -"${SIG:-INT}" -- -"$PGID"
while kill -0 $PID 2>/dev/null; do sleep 0.5; done
echo "main exited after $(echo "$(date +%s.%N) - $T0" | bc) s"
sleep 2; echo "left: $(ps aux | grep -E 'raylet|gcs_server|prefixserve serve|ray::' | grep -v grep | wc -l)"
grep "^prefixserve:" "$LOG"
