"""kvcore's benchmarks, importable so that ``python -m kvcore bench`` runs
them from an installed wheel; ``bench/*.py`` are thin scripts over these.

Each module has ``run(quick=False, ...) -> dict`` (numbers) and
``report(results) -> str`` (a table).  Speed is compared against baselines
measured in the same run; ratios and medians only.
"""
