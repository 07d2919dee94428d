"""profile_host.py with the module epoch defeated: every replay runs the full attribute and
module-tree comparisons, as before the epoch (a paired 'before' for issue 45)."""

import runpy
import sys

import tgraph.layers.replay as replay

_check = replay.check


def check(cap, state):
    state.module_epoch = -1
    return _check(cap, state)


replay.check = check
sys.argv = ["profile_host.py", *sys.argv[1:]]
runpy.run_path(__file__.replace("_no_epoch", ""), run_name="__main__")
