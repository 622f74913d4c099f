"""Model staging (issue 16): the workers' model path holds exactly the source before any
worker starts, never half-copied (docs/staging.md).

Pure: `manifest` (what a copy holds), `plan` (what to copy, whether it fits), `progress`
(bytes, rate, time left), `failure` (what went wrong, with the fix).
I/O: `space` (free space, the mount and its options), `lock` (one stage at a time),
`source` (a local directory's manifest), `hub` (a Hugging Face download), `copier`
(copy, verify, rename into place), `warm` (the page cache), `runner` (all of it in order).
"""
