"""One module per command that is not a package of its own: diff (and diffsides, its sides given as
files), replay, report, doctor, pack, verify. diagnose/, locate/, training/ and fleet/ are the
commands that grew into packages; they sit in the same layer, beside this one."""
