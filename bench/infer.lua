-- wrk script: POST one inference request to the URL wrk is given (body and key from the
-- environment; no Authorization header when BENCH_KEY is empty, as for the peer model servers)
-- and print a JSON summary line that bench/oip_bench.py parses.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("BENCH_KEY") or ""
if key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end
wrk.body = os.getenv("BENCH_BODY")

done = function(summary, latency, requests)
  local errors = summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout
  io.write(string.format(
    'BENCH {"requests": %d, "duration_us": %d, "errors": %d, "p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, errors,
    latency:percentile(50), latency:percentile(99)))
end
