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
