"""python -m kvcore: subcommands, options and exit statuses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcore
from kvcore import cli

# The directory holding the kvcore this test imported: the source tree for an
# editable install, site-packages for an installed wheel or sdist (the tests
# also run from an unpacked sdist, whose own kvcore/ is not built).
ROOT = Path(kvcore.__file__).resolve().parents[1]


def run_cli(*args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kvcore", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_demo_subprocess():
    p = run_cli("demo", "--requests", "2", "--prompt-len", "32", "--new-tokens", "4")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("kvcore demo:")
    for row in ("requests", "prefix-cache hit rate", "tokens/s, kvcore paged", "verification"):
        assert any(line.startswith(row) for line in lines), row
    assert "PASS" in p.stdout
    assert "[kvcore paged] step" in p.stderr       # progress on stderr, not stdout
    assert "[kvcore paged]" not in p.stdout


def test_bench_help_subprocess():
    p = run_cli("bench", "--help")
    assert p.returncode == 0, p.stderr
    for opt in ("--full", "--json", "--plot"):
        assert opt in p.stdout


def test_top_level_help():
    p = run_cli("--help")
    assert p.returncode == 0
    assert "demo" in p.stdout and "bench" in p.stdout


@pytest.mark.parametrize("argv", [
    ["demo", "--requests", "0"],
    ["demo", "--requests", "two"],
    ["demo", "--dtype", "float8"],
    ["demo", "--device", "tpu"],
    ["demo", "--num-blocks", "1"],
    ["demo", "--frobnicate"],
    ["bench", "--only", "nope"],
    ["bench", "--repeat", "0"],
    ["serve"],
])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_bad_option_subprocess_exit_2():
    p = run_cli("demo", "--prompt-len", "-5")
    assert p.returncode == 2
    assert "prompt-len" in p.stderr


def test_no_subcommand_runs_the_demo(monkeypatch):
    from kvcore.cli import demo

    seen = []
    monkeypatch.setattr(demo, "run_from_args", lambda args, parser: seen.append(args) or 0)
    assert cli.main([]) == 0
    assert seen and seen[0].command == "demo" and seen[0].requests == demo.DEFAULTS["requests"]


FAKE_SWEEP = {"points": [{"tokens": n, "bytes": 12288 * n, "kvcore_gb_s": 10.0,
                          "numpy_gb_s": 2.0, "ratio_numpy": 5.0} for n in (1, 16)],
              "config": {"quick": True}}


def test_bench_table_json_and_notes(monkeypatch, tmp_path, capsys):
    from kvcore.cli.benchmarks import sweep

    monkeypatch.setattr(sweep, "run", lambda quick=False: FAKE_SWEEP)
    monkeypatch.setattr(cli, "_gpu_available", lambda: "no CUDA GPU")
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--only", "sweep,gpu", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "paged write 16 tok" in stdout and "5.0x" in stdout
    # the GPU benchmark is skipped with a note when there is no GPU
    assert "note: gpu: skipped: no CUDA GPU" in stdout
    data = json.loads(out.read_text())
    assert data["results"]["sweep"]["points"][1]["tokens"] == 16
    assert data["results"]["gpu"] == {"skipped": "skipped: no CUDA GPU"}
    assert data["quick"] is True


def test_bench_hf_without_torch_is_a_clean_skip():
    """``bench --only hf`` where torch cannot be imported: a skip line naming
    what is missing, as for gpu, never a traceback (issue 39 item 5)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import sys; sys.modules['torch'] = None; from kvcore.cli import main; "
            "sys.exit(main(['bench', '--only', 'hf']))")        # import torch fails
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert "note: hf: skipped: kvcore.hf needs torch and transformers" in p.stdout


def test_bench_skips_a_missing_optional_module(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *a):
        if name == "kvcore.cli.benchmarks.convert":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", fake)
    mod, why = cli._load("convert")
    assert mod is None and "not in this build" in why


def test_bench_plot_without_matplotlib(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib fails
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--only", "sweep", "--plot", "x.png"])
    assert e.value.code == 2
    assert "matplotlib" in capsys.readouterr().err


def test_every_benchmark_module_owns_its_rows():
    import importlib

    for name, _ in cli.BENCHMARKS:
        try:
            mod = importlib.import_module(f"kvcore.cli.benchmarks.{name}")
        except ImportError:          # an optional benchmark (gpu without CuPy is fine)
            continue
        assert callable(getattr(mod, "rows", None)), f"{name} has no rows(result)"
        assert callable(getattr(mod, "run", None)), f"{name} has no run()"
    with pytest.raises(TypeError, match="no rows"):
        cli._summary_rows("x", object(), {})


FAKE_LOWPREC = {
    "tokens": 1024, "ctx": 512,
    "write_gelem_s": {"float16": 1.0, "float8_e4m3fn": 0.7, "float8_e5m2": 0.9, "int8": 0.8},
    "write_ratio_vs_f16": {"float16": 1.0, "float8_e4m3fn": 0.7, "float8_e5m2": 0.9,
                           "int8": 0.8},
    "bytes_per_token": {"float16": 4096, "float8_e4m3fn": 2048, "float8_e5m2": 2048,
                        "int8": 2112},
    "bytes_ratio_vs_f16": {"float16": 1.0, "float8_e4m3fn": 0.5, "float8_e5m2": 0.5,
                           "int8": 0.516},
    "decode_gb_s": {"float16": 4.0, "float8_e4m3fn": 2.2, "float8_e5m2": 2.4, "int8": 2.3},
    "decode_ratio_vs_f16": {"float16": 1.0, "float8_e4m3fn": 0.55, "float8_e5m2": 0.6,
                            "int8": 0.57},
    "decode_time_ratio_vs_f16": {"float16": 1.0, "float8_e4m3fn": 1.1, "float8_e5m2": 1.2,
                                 "int8": 1.14},
}


def test_bench_prints_the_lowprec_rows_and_the_machine(monkeypatch, capsys):
    # `--only lowprec` used to print no row at all
    from kvcore.cli.benchmarks import lowprec

    monkeypatch.setattr(lowprec, "run", lambda quick=False: FAKE_LOWPREC)
    assert cli.main(["bench", "--only", "lowprec", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for dtype in ("float8_e4m3fn", "float8_e5m2", "int8"):
        assert f"{dtype}: paged write" in out and f"{dtype}: decode" in out
    assert "0.70x" in out and "0.516 of" in out
    assert "CPU: " in out and "SIMD: " in out and "versions: numpy " in out
    assert "ratio_" not in out and "_gb_s" not in out       # no raw key names


def test_bench_attention_rows_fill_every_column():
    from kvcore.cli.benchmarks import attention

    dec = {"context": 4096, "batch": 8, "kvcore_1t_s": 0.02, "kvcore_GBps": 6.7,
           "stream_GBps": 17.9, "fraction_of_stream": 0.37, "torch_f32_s": 0.05,
           "torch_bf16_s": 0.027, "numpy_s": 0.08, "speedup_vs_torch_f32": 2.5,
           "speedup_vs_torch_bf16": 1.37, "speedup_vs_numpy": 4.0}
    pre = {"tokens": 2048, "kvcore_1t_s": 0.446, "kvcore_GFLOPps": 77.0, "torch_f32_s": 0.29,
           "torch_bf16_s": 0.09, "speedup_vs_torch_f32": 0.65, "speedup_vs_torch_bf16": 0.2}
    rows = attention.rows({"decode": {"ctx4096_b8": dec}, "prefill": {"n2048": pre}})
    assert rows[0][0] == "attention decode ctx 4096 x batch 8" and rows[0][1] == "20.000 ms"
    assert ("", "", "50.000 ms (torch SDPA float32)", "2.5x") in rows
    assert any(r[0].startswith("attention causal prefill 2048") and r[1] for r in rows)
    assert all(len(r) == 4 and r[2] for r in rows)


def test_bench_eta():
    assert cli._eta(30.0, 1, 3) == ", ETA 60 s" or cli._eta(30.0, 1, 3).startswith(", ETA 1 min")
    assert cli._eta(10.0, 2, 4) == ", ETA 10 s"
    assert cli._eta(0.0, 0, 3) == "" and cli._eta(5.0, 3, 3) == ""


def test_bench_plot_draws_the_spread(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from kvcore.cli.benchmarks import sweep

    ratios = iter([4.0, 6.0])
    monkeypatch.setattr(sweep, "run", lambda quick=False: {
        "points": [{"tokens": 16, "kvcore_gb_s": next(ratios), "numpy_gb_s": 1.0,
                    "ratio_numpy": 5.0}], "config": {}})
    png = tmp_path / "s.png"
    assert cli.main(["bench", "--only", "sweep", "--repeat", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_repeat_prints_median_and_spread(monkeypatch, tmp_path, capsys):
    # README numbers come from `python -m kvcore bench --repeat N`: every number
    # is the median over the runs, with its [min-max] range.
    from kvcore.cli.benchmarks import sweep

    ratios = iter([4.0, 6.0, 5.0])

    def fake_run(quick=False):
        r = next(ratios)
        return {"points": [{"tokens": 16, "bytes": 12288 * 16, "kvcore_gb_s": 2.0 * r,
                            "numpy_gb_s": 2.0, "ratio_numpy": r}], "config": {"quick": quick}}

    monkeypatch.setattr(sweep, "run", fake_run)
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--only", "sweep", "--repeat", "3", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "median of 3 runs" in stdout
    assert "5.0x [4.0-6.0]" in stdout
    assert "10.00 [8.00-12.00] GB/s" in stdout
    assert "2.00 GB/s (NumPy)" in stdout            # a number that did not vary: no range
    data = json.loads(out.read_text())
    assert data["repeat"] == 3
    assert [p["points"][0]["ratio_numpy"] for p in data["runs"]["sweep"]] == [4.0, 6.0, 5.0]
    assert data["results"]["sweep"]["points"][0]["ratio_numpy"] == 5.0
    assert data["results"]["sweep"]["points"][0]["tokens"] == 16


def test_spread_helpers():
    from kvcore.cli.benchmarks._timing import aggregate, spread_lines, with_spread

    runs = [{"a": 1.0, "n": 7, "name": "x", "l": [3.0]},
            {"a": 3.0, "n": 7, "name": "y", "l": [1.0]},
            {"a": 2.0, "n": 7, "name": "z", "l": [2.0]}]
    assert aggregate(runs, "median") == {"a": 2.0, "n": 7, "name": "x", "l": [2.0]}
    assert aggregate(runs, "min")["a"] == 1.0 and aggregate(runs, "max")["l"] == [3.0]
    got = with_spread("2.0x at 7 tok", "1.0x at 7 tok", "3.0x at 7 tok")
    assert got == "2.0x [1.0-3.0] at 7 tok"
    assert with_spread("2.0 us", "2.0 us", "2.0 us") == "2.0 us"
    assert spread_lines(runs) == ["a: 2 [1-3]", "l[0]: 2 [1-3]"]


def test_bench_hashing_rows():
    r = {"tokens": 2048, "block_size": 16, "kvcore_array_us": 15.0, "kvcore_list_us": 49.0,
         "python_us": 300.0, "ratio_array": 20.0, "ratio_list": 300 / 49}
    from kvcore.cli.benchmarks import hashing

    rows = hashing.rows(r)
    assert rows[0][:2] == ("block_hashes, 2048-token prompt (int32 array)", "15.0 us")
    assert rows[1][1:] == ("49.0 us", "", "6.1x")


def test_bench_attention_prefill_runs():
    """The prefill rows time kvcore and torch with at least two repeats (the
    timing loop's keyword once went missing and every `bench` run crashed
    there)."""
    from kvcore.cli.benchmarks import attention

    torch, F = attention._torch()
    r = attention.bench_prefill(32, np.random.default_rng(0), 0.0, torch, F, threads=(1,))
    assert r["tokens"] == 32 and r["kvcore_1t_s"] > 0
    lo, hi = r["kvcore_1t_s_range"]
    assert lo <= r["kvcore_1t_s"] <= hi
    if torch is not None:
        assert r["torch_f32_s"] > 0 and r["torch_bf16_s"] > 0
        assert r["max_rel_diff_vs_torch_f32"] < 1e-4


def test_bench_attention_prefill_shapes_include_smollm2():
    """`bench_attention.py --only-prefill`: the default shape and SmolLM2's
    (9/3 heads, head_dim 64), each checked against torch where it exists."""
    from kvcore.cli.benchmarks import attention

    res = attention.run_prefill_shapes(quick=True)
    assert set(res["prefill"]) == {"n256", "smollm2_n256"}
    assert res["prefill"]["smollm2_n256"]["shape"] == [9, 3, 64]
    assert res["prefill"]["smollm2_n256"]["flops"] == 4.0 * 256 * 256 / 2 * 64 * 9
    if res["torch"] is not None:
        assert res["prefill"]["smollm2_n256"]["max_rel_diff_vs_torch_f32"] < 1e-4
    text = attention.report(res)
    assert "smollm2_n256 (9/3 heads, d=64)" in text and "decode " not in text


def test_bench_attention_ceilings_rows_per_page_dtype():
    """`bench_attention.py --only-ceilings`: every page dtype, out of the
    caches and in them, positive rates within their range, and float16 out
    of the caches the unit of the ratios (a tiny shape: the rows, not the
    speed)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "bench_attention", Path(__file__).resolve().parents[2] / "bench" / "bench_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.page_ceilings(quick=True, shapes=(("tiny", (4, 2, 64), 2, 64),),
                              warm_context={64: 32})
    rows = res["ceilings"]["tiny"]["rows"]
    assert set(rows) == {f"{d}_{w}" for d in bench.CEILING_DTYPES for w in ("cold", "cache")}
    for row in rows.values():
        lo, hi = row["range"]
        assert 0 < lo <= row["positions_per_s"] <= hi
    assert rows["float16_cold"]["vs_float16_cold"] == pytest.approx(1.0)
    text = bench.ceilings_report(res)
    assert "float8_e5m2" in text and "2 x 32 in them" in text


def test_bench_attention_alignment_rows():
    """`bench_attention.py --only-alignment`: per page dtype, both layouts
    timed, and the pools kvcore allocates afterwards on a line again (the
    bench's stand-in allocator is put back)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "bench_attention", Path(__file__).resolve().parents[2] / "bench" / "bench_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.alignment(quick=True, shapes=(("tiny", (4, 2, 64), 2, 64),))
    rows = res["alignment"]["tiny"]["rows"]
    assert set(rows) == set(bench.ALIGN_DTYPES)
    for row in rows.values():
        assert row["line_s"] > 0 and row["offset16_s"] > 0
        assert row["speedup"] == pytest.approx(row["offset16_s"] / row["line_s"])
    assert "on a line" in bench.alignment_report(res)
    assert kvcore.BlockPool(1, 16, 1, 2, 64).storage.ctypes.data % 64 == 0
