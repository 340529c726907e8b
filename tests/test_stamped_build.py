"""tools/stamped_build.py: edits that must apply exactly once, and the
moe_forward signature the stamped tools' wrappers pass on (each tool's
wrapper checked here, one test for both)."""
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
import cta_timeline  # noqa: E402
import route_phases  # noqa: E402
import solution  # noqa: E402
import stamped_build  # noqa: E402


def test_edits_apply_in_order():
    assert stamped_build.apply_edits("a b c", [("b", "x b"), ("x b c", "y")], "tool") == "a y"


@pytest.mark.parametrize("source, times", [("a", 0), ("b b", 2)])
def test_an_edit_that_does_not_match_once_refuses_and_names_the_tool(source, times):
    with pytest.raises(SystemExit, match=f"tool: an edit matches {times} times, not once"):
        stamped_build.apply_edits(source, [("b", "c")], "tool")


def test_the_signature_passes_every_parameter_in_order():
    params, arguments = stamped_build.moe_forward_signature(solution.HOST_DECLARATION)
    names = arguments.split(", ")
    assert params.split()[0:2] == ["torch::Tensor", "hidden_states,"]
    assert names[0] == "hidden_states" and names[-1] == "stage2_row_tiles" and len(names) == params.count(",") + 1


@pytest.mark.parametrize("tool", [cta_timeline, route_phases], ids=["cta_timeline", "route_phases"])
def test_each_tools_wrapper_passes_every_parameter_in_order(tool):
    declaration, definition = tool.wrapper_source(solution.HOST_DECLARATION)
    assert declaration.startswith(solution.HOST_DECLARATION) and "moe_forward_stamped(" in declaration
    call = definition.split("    moe_forward(")[1].split(");")[0].split(", ")
    assert call[0] == "hidden_states" and call[-1] == "stage2_row_tiles" and len(call) == 23
