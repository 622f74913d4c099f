"""Model staging (issue 16): the workers' model path holds exactly the source before any
worker starts, never half-copied (docs/staging.md).

Pure: `manifest` (what a copy holds), `plan` (what to copy, whether it fits), `progress`
(bytes, rate, time left), `failure` (what went wrong, with the fix), `state` (the stage's
states, its view and transitions), `stale` (which workers are on an old copy, when it goes).
I/O: `space` (free space, the mount and its options), `lock` (one stage at a time),
`source` (a local directory's manifest), `hub` (a Hugging Face download), `copier`
(copy, verify, rename into place), `warm` (the page cache), `runner` (all of it in order),
`driver` (the agent's side: a stage run, its view kept, an old copy removed).
"""
