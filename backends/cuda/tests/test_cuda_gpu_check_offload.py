"""``bench/gpu_check.py``'s ``offload`` check at toy sizes on the CPU, in this process: its rows
are produced (copy rates are information there) and the prompt comes back from the host tier."""

from __future__ import annotations

from pathlib import Path

from gpu_check_script import gpu_check_module


def test_cpu_smoke_rows(tmp_path: Path) -> None:
    gc = gpu_check_module()
    args = gc.parse_args(["--device", "cpu", "--out", str(tmp_path), "--only", "offload"])
    table = gc.Table()
    gc.check_offload(table, args, tmp_path)
    assert not table.failed, [r.line() for r in table.failed]
    names = [r.check for r in table.rows]
    assert names[:4] == [
        f"offload: {label} copy, 16 x 32 KiB blocks"
        for label in ("save batched", "load batched", "save per block", "load per block")
    ]
    assert names[4] == "offload: TTFT ctx=256 from the host tier vs cold (8B shape)"
    ttft = table.rows[4]
    assert ttft.ok is True, ttft.line()
    for row in table.rows:
        print(row.line())
