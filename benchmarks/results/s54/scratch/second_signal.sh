# From the repository root: bash benchmarks/results/s54/scratch/second_signal.sh
# A 4000-token stream, then SIGTERM to the CLI and a second SIGTERM 2 s later; prints the time to exit, the stream's
# end and the CLI's own lines.
LOG=/tmp/second_signal.log
.venv/bin/prefixserve serve --port 8414 > "$LOG" 2>&1 &
PID=$!
for i in $(seq 1 90); do sleep 2; grep -q "prefixserve: serving" "$LOG" && break; done
curl -s -N http://127.0.0.1:8414/v1/completions -H 'content-type: application/json' \
  -d '{"prompt":"Once upon a time","max_tokens":4000,"stream":true,"ignore_eos":true}' > /tmp/second_signal_stream.txt &
sleep 3; T0=$(date +%s.%N); kill -TERM $PID; sleep 2; kill -TERM $PID
while kill -0 $PID 2>/dev/null; do sleep 0.5; done
echo "exited after $(echo "$(date +%s.%N) - $T0" | bc) s"; tail -c 300 /tmp/second_signal_stream.txt; echo
grep "^prefixserve:" "$LOG"
