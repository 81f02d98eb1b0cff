"""scripts/ncu_stalls.py on a small file in the layout of ncu's `--page source --csv` output."""

from __future__ import annotations

from helpers import load_script

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_long_sb (Not Issued)",'
          '"stall_barrier"')
CSV = "\n".join([
    "==PROF== Connected to process 1",
    '"Kernel Name","_gemm1_swiglu_kernel",',
    HEADER,
    '"0x10","LDG.E.U16 R3, desc[UR14][R58.64]","10","0","0","10"',
    '"0x20","LOP3.LUT R37, R3, 0xffff, RZ, 0xc0, !PT","70","60","30","0"',
    '"0x30","@P0 HMMA.16816.F32.BF16 R40, R52, R36, R40","20","0","0","5"',
    '"Kernel Name","_gemm2_kernel",',
    HEADER,
    '"0x40","STS.U8 [R51+0x2000], R28","3","3","1","0"',
    '"0x50","LDS R30, [R50+UR6+0x2000]","1","0","0","1"',
])  # fmt: skip


def test_each_kernel_gets_its_own_rows_and_shares():
    ncu = load_script("scripts/ncu_stalls.py")
    sections = list(ncu._sections(CSV))
    assert [(name, len(rows)) for name, rows in sections] == [("_gemm1_swiglu_kernel", 3), ("_gemm2_kernel", 2)]
    lines = ncu.summarise(sections[0][1], top=2)
    assert "100" in lines[0]  # total samples
    assert lines[1].split()[0] == "70.0%" and "LOP3.LUT" in lines[1] and "stall_long_sb=60" in lines[1]
    assert "(Not Issued)" not in lines[1]
    assert lines[2].split()[0] == "20.0%" and len(lines) == 4
    assert lines[3] == "  by opcode: LOP3 70.0%, HMMA 20.0%, LDG 10.0%"  # the predicate is not the opcode
    assert ncu.summarise(sections[1][1], top=1)[1].split()[0] == "75.0%"
