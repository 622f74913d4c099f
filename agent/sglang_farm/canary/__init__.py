"""Pure: canary analysis (issue 23; docs/canary.md): judge a changed worker against the
workers still on the old config, over the same window, behind the same gateway.

- `promtext`: Prometheus text bodies (SGLang's and smg's /metrics) into samples;
- `figures`: histograms, counters and their deltas over a window (resets handled),
  PromQL's `histogram_quantile`, a worker's `Figures`;
- `verdict`: `judge()`: promote, rollback or inconclusive, with the evidence in one line;
- `record`: the hash of what the workers would run, and the rejected-change rule;
- `evalset`: the eval gate's core: an eval set (JSON Lines), answers taken GSM8K-style,
  scores, `eval_verdict()` (canary's score against a baseline worker's);
- `evalrun` (I/O): sends an eval set to a worker's /v1/chat/completions and runs the
  gate on the canary and a baseline worker;
- `rollout`: the analysis of a reload's change as a state machine (wait for the canary,
  the window, liveness failures, `resolve` a verdict), `spec_change` (a config's hash);
- `view`: `RolloutVerdictView`, the analysis as `FarmView.canary` shows it;
- `driver` (I/O): the agent's side: the gated waves, scrapes, judging, promote,
  rollback, the held change; `store` (I/O): the record in the state directory.
"""
