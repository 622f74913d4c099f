"""farmctl's verbs, one module per verb or close family of verbs (as circus keeps its
commands in `circus/commands/`); `cli/farmctl` builds the click group and registers them.

The modules below share what every verb needs (`exits`: the exit codes; `connection`: the
socket and the agent's errors as farmctl's; `args`: the arguments several verbs take;
`text`: durations, tables, lists of workers) and otherwise import each other only where
one verb ends in another's work (restart and reload follow workers as `follow` does).
Like `cli/farmctl`, they import only click, the standard library and the control client
at module level: `farmctl status` starts in a few tens of milliseconds.
"""
