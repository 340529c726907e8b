"""tools/sass_diff.py: reading cuobjdump's lines, and telling a register renaming from a changed schedule."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import sass_diff  # noqa: E402

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe20000000800 */
        /*0010*/                   IMAD R108, R22.reuse, 0x8080800, R13 ;  /* 0x08080800166c7824 */
"""


def test_instructions_keep_only_addressed_lines_without_encodings():
    assert sass_diff.instructions(SASS) == ["LDC R1, c[0x0][0x28] ;", "IMAD R108, R22.reuse, 0x8080800, R13 ;"]


def test_a_renaming_compares_equal_and_a_reordering_does_not():
    a = ["IMAD R108, R22.reuse, 0x8080800, R13 ;", "PRMT R104, R11, R10, R8 ;"]
    renamed = ["IMAD R23, R104, 0x8080800, R13 ;", "PRMT R105, R11.reuse, R10, R8 ;"]
    assert sass_diff.without_register_names(a) == sass_diff.without_register_names(renamed)
    assert sass_diff.without_register_names(a) != sass_diff.without_register_names(renamed[::-1])
    # A different immediate is a different instruction, not a renaming.
    changed = ["IMAD R23, R104, 0x8080808, R13 ;", renamed[1]]
    assert sass_diff.without_register_names(a) != sass_diff.without_register_names(changed)


def test_branch_targets_become_labels_that_an_insertion_elsewhere_leaves_alone():
    before = ["@!P0 BRA 0x40 ;", "BSSY B0, 0x60 ;", "IMAD R1, R2, 0x40, R3 ;", "BRA 0x60 ;"]
    # One instruction added ahead of both targets: every target address moves by 0x10.
    after = ["@!P0 BRA 0x50 ;", "BSSY B0, 0x70 ;", "IMAD R1, R2, 0x40, R3 ;", "NOP ;", "BRA 0x70 ;"]
    labelled = sass_diff.with_branch_labels(before)
    assert labelled == ["@!P0 BRA L0 ;", "BSSY B0, L1 ;", "IMAD R1, R2, 0x40, R3 ;", "BRA L1 ;"]
    assert [line for line in sass_diff.with_branch_labels(after) if line != "NOP ;"] == labelled
    # A branch to a different place is still a different instruction.
    assert sass_diff.with_branch_labels(["@!P0 BRA 0x60 ;", "BSSY B0, 0x40 ;"]) != labelled[:2]
