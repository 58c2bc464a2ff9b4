"""``bench/gpu_check.py``'s ``pd_ipc`` check on the CPU: a second process copies the pages of this
one's KV tensor (shared memory here, CUDA IPC on a GPU) and they arrive exact."""

from __future__ import annotations

from pathlib import Path

from gpu_check_script import gpu_check_module


def test_cpu_smoke_row(tmp_path: Path) -> None:
    gc = gpu_check_module()
    args = gc.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    table = gc.Table()
    gc.check_pd_ipc(table, args, tmp_path)
    assert not table.failed, [r.line() for r in table.failed]
    [row] = table.rows
    assert row.check == "pd_ipc: 8 KV pages over shared memory"
    assert "GB/s" in row.value and "exact: True" in row.value
