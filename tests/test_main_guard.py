"""A script that fits on the embedded cluster from its top level, outside ``if __name__ ==
"__main__":``, is named before any process starts (pure checks of the source here; the
end-to-end case is tests/test_cli.py::test_script_without_main_guard_gets_a_clear_error)."""

import sys

from dataflow.runtime.main_guard import line_is_guarded, unguarded_script_line

SCRIPT = """import dataflow as dfl
pipe = dfl.Pipeline(...)
pipe.fit(epochs=1)                      # line 3: top level
if __name__ == "__main__":
    pipe.fit(epochs=1)                  # line 5
if "__main__" == __name__ and True:
    pipe.fit(epochs=1)                  # line 7
def main():
    pipe.fit(epochs=1)                  # line 9
class Job:
    result = None                       # line 11
if __name__ != "__main__":
    pass
else:
    pipe.fit(epochs=1)                  # line 15
for _ in range(2):
    pipe.fit(epochs=1)                  # line 17: top level too
"""


def test_only_lines_under_a_main_test_or_in_a_body_are_guarded():
    guarded = {n for n in range(1, 18) if line_is_guarded(SCRIPT, n)}
    assert {3, 17}.isdisjoint(guarded)
    assert {5, 7, 9, 11, 15} <= guarded


def test_source_it_cannot_parse_is_never_refused():
    assert line_is_guarded("def broken(:\n", 1)


def test_no_script_frame_on_the_stack_means_nothing_to_say():
    # pytest's __main__ calls tests from functions: no unguarded top-level line
    assert unguarded_script_line(sys._getframe()) is None
