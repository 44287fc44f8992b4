"""kvcore/cli/benchmarks/stores.py (bench/bench_stores.py) on tiny sizes:
its rows come through the same ``rows(result)`` shape as every benchmark
module's, and ``python -m kvcore bench --only stores`` prints them (speed is
never asserted)."""
import subprocess
import sys
from pathlib import Path

from kvcore import cli
from kvcore.cli.benchmarks import stores

ROOT = Path(__file__).resolve().parents[2]


def tiny():
    return stores.run(tokens=32, layers=2, heads=2, dim=16, n_samples=2,
                      only=["checksum", "host", "disk"])


def test_stores_rows_have_the_benchmark_table_shape():
    r = tiny()
    rows = stores.rows(r)
    names = [row[0] for row in rows]
    assert len(rows) == 4 and all(len(row) == 4 for row in rows)
    assert all(isinstance(c, str) for row in rows for c in row)
    assert names[0].startswith("checksum XXH3-64") and "GB/s" in rows[0][1]
    assert any("from host" in n for n in names) and any("from disk" in n for n in names)
    for name in ("host", "disk"):
        row = r["rows"][name]
        assert row["kvcore"]["min_s"] <= row["kvcore"]["median_s"] <= row["kvcore"]["max_s"]
        assert row["ratio"] > 0
    text = stores.report(r)
    assert "vs memcpy" in text and "goal" in text
    dp = r["disk_put"]
    assert dp["entries"] == 16 and dp["bytes"] > 16 * 16384
    for key in ("quiet", "busy", "python_busy", "get_quiet", "get_busy", "python_get_busy"):
        assert dp[key]["min_s"] <= dp[key]["median_s"] <= dp[key]["max_s"]
    assert "DiskStore.put of 16 entries" in text and "DiskStore.contains + get of them" in text


def test_bench_only_stores_prints_its_rows(monkeypatch, capsys):
    result = tiny()
    monkeypatch.setattr(stores, "run", lambda quick=False: result)
    assert cli.main(["bench", "--only", "stores", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "checksum XXH3-64" in out and "from host" in out


def test_stores_is_only_run_on_request():
    assert "stores" in cli.ON_REQUEST


def test_bench_stores_script_refuses_bad_options():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_stores.py"), "--tokens",
                          "30"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "multiple of 16" in run.stderr
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_stores.py"), "--only",
                          "tape"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "unknown rows" in run.stderr


def test_stores_redis_rows_time_a_lookup_beside_a_busy_thread():
    from _stores_support import require_redis
    require_redis()
    r = stores.run(tokens=32, layers=2, heads=2, dim=16, n_samples=2, only=["redis"])
    row = r["rows"]["redis"]
    assert "skipped" not in row and row["ratio"] > 0
    rl = r["redis_lookup"]
    assert rl["entries"] == 2
    for key in ("quiet", "busy", "raw_busy"):
        assert rl[key]["min_s"] <= rl[key]["median_s"] <= rl[key]["max_s"]
    assert "RedisStore.contains + get of the prefix's 2 entries" in stores.report(r)
