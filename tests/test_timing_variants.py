"""tools/timing_variants.py: every variant still applies to this solution.py,
each changes the source, and a variant that no longer matches refuses."""
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import timing_variants  # noqa: E402

SOURCE = open(os.path.join(ROOT, "solution.py")).read()


@pytest.mark.parametrize("name", sorted(timing_variants.VARIANTS))
def test_each_variant_applies_once_and_changes_the_source(name):
    changed = timing_variants.apply(SOURCE, name)
    assert changed != SOURCE
    for alternatives in timing_variants.VARIANTS[name][1]:
        # made: old's count falls or new's grows (`new in changed` alone held for new texts the
        # source already had, whether or not the edit was made)
        assert sum(SOURCE.count(old) == 1 and (changed.count(old) < SOURCE.count(old)
                                               or changed.count(new) > SOURCE.count(new))
                   for old, new in alternatives) == 1


def test_variants_combine():
    both = timing_variants.apply(SOURCE, "wide_no_act_copy+wide_no_dequant")
    assert both == timing_variants.apply(timing_variants.apply(SOURCE, "wide_no_act_copy"), "wide_no_dequant")


def test_a_variant_whose_text_is_gone_refuses():
    with pytest.raises(SystemExit, match=r"0 of an edit's \d+ forms"):
        timing_variants.apply(SOURCE.replace("bf16_fragment_half", "renamed"), "wide_no_dequant")


def test_an_unknown_variant_refuses():
    with pytest.raises(SystemExit, match="no variant"):
        timing_variants.apply(SOURCE, "no_such_variant")


def test_files_are_written_under_their_names(tmp_path):
    source = tmp_path / "solution.py"
    source.write_text(SOURCE)
    timing_variants.main(["--source", str(source), "--out", str(tmp_path / "ab"), "wide_no_act_copy+wide_no_dequant"])
    written = tmp_path / "ab" / "timing_wide_no_act_copy_and_wide_no_dequant.py"
    assert written.read_text() == timing_variants.apply(SOURCE, "wide_no_act_copy+wide_no_dequant")


@pytest.mark.parametrize("argv", [["--help"], ["wide_no_act_copy", "no_such_variant"]])
def test_a_bad_command_line_writes_no_file(tmp_path, argv):
    source = tmp_path / "solution.py"
    source.write_text(SOURCE)
    with pytest.raises(SystemExit):
        timing_variants.main(["--source", str(source), "--out", str(tmp_path / "ab"), *argv])
    assert not (tmp_path / "ab").exists() or not any((tmp_path / "ab").iterdir())


def test_an_edit_takes_whichever_of_its_forms_the_source_has(monkeypatch):
    monkeypatch.setitem(timing_variants.VARIANTS, "toy", ("toy", [(("alpha", "A"), ("beta", "B"))]))
    assert timing_variants.apply("x beta y", "toy") == "x B y"
    assert timing_variants.apply("x alpha y", "toy") == "x A y"
    with pytest.raises(SystemExit, match="2 of an edit's 2 forms"):
        timing_variants.apply("alpha beta", "toy")
