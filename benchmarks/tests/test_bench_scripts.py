"""The benchmark scripts' logic that runs without a GPU: their eager baselines are the reference's
step and sampler (negative controls included), their tables and target verdicts on made-up rows,
the SASS census's parser and budgets, and the decode-graphs benchmark's eager part.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    import sys

    if str(ROOT / "benchmarks") not in sys.path:  # as when run as a script: they import each other
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_gpu_benchmark():
    return load_benchmark("bench_accept_cuda")


@pytest.mark.parametrize("extra", [{}, {"rule": "sd"}, {"divergence": "kl"}, {"top_p": 0.9}],
                         ids=["fsd-js", "sd", "fsd-kl", "top_p"])
def test_gpu_benchmark_eager_step_is_the_reference_step(extra):
    """The speed-ups over eager PyTorch compare against the same step: benchmarks/bench_accept_cuda.py's
    torch_step gives the reference's tokens, acceptances and divergences for each shape's options
    when fed the same uniforms (float32 against float64: no row of these sits on a rounding edge)."""
    from fsd_ext import reference

    bench = load_gpu_benchmark()
    batch, k, vocab = 64, 4, 300
    g = torch.Generator().manual_seed(3)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 3
    draft = target[:, :k] + 2 * torch.randn(batch, k, vocab, generator=g)  # js around the threshold
    tokens = torch.randint(0, vocab, (batch, k), generator=g)
    coins, uniforms = torch.rand(batch, k, generator=g), torch.rand(batch, generator=g)
    options = bench.step_options(extra)
    threshold = 1.3 if options["divergence"] == "kl" else 0.25  # about the median divergence here
    n_acc, pick, div = bench.torch_step(target, draft, tokens, coins, uniforms, threshold, **options)
    ref = reference.accept(target, draft, tokens, rule=options["rule"], divergence=options["divergence"],
                           threshold=threshold, top_p=options["top_p"], coin_uniforms=coins,
                           sample_uniforms=uniforms[:, None].expand(batch, k + 1), return_divergence=True)
    assert torch.equal(n_acc, ref.num_accepted)
    assert 0 < n_acc.float().mean() < k  # acceptances and rejections both happen
    assert torch.equal(pick, ref.tokens[torch.arange(batch), ref.num_accepted])
    if options["rule"] == "fsd":
        torch.testing.assert_close(div, ref.divergence, rtol=1e-4, atol=1e-6)
    else:
        assert div is None  # sd: the kernels compute no divergence either
    # Negative control: the same comparison notices a step that ignores the filter or the rule.
    wrong = dict(options, top_p=0.5) if options["top_p"] else dict(options, rule="fsd" if options["rule"] == "sd" else "sd")
    n_wrong, pick_wrong, _ = bench.torch_step(target, draft, tokens, coins, uniforms, threshold, **wrong)
    assert not (torch.equal(n_wrong, ref.num_accepted) and torch.equal(pick_wrong, pick))


@pytest.mark.parametrize("filters", [{}, {"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}],
                         ids=["plain", "top_k", "top_p", "min_p"])
def test_sample_benchmark_eager_sampler_is_the_reference_sampler(filters):
    """benchmarks/bench_sample_cuda.py's eager baseline draws fsd_ext.reference.sample's tokens from
    the same uniforms (float32 against float64: no row of these sits on a rounding edge)."""
    from fsd_ext import reference

    bench = load_benchmark("bench_sample_cuda")
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(256, 3000, generator=g) * 3).to(torch.bfloat16)
    uniforms = torch.rand(256, generator=g, dtype=torch.float64)
    expected = reference.sample(logits, bench.TEMPERATURE, uniforms=uniforms, **filters)
    tokens = bench.torch_sample(logits, uniforms.float(), bench.TEMPERATURE, **filters)
    assert torch.equal(tokens, expected)
    assert len(set(tokens.tolist())) > 100  # draws spread over the rows' own distributions
    # Negative control: the comparison notices a sampler with another filter or temperature.
    other = {"top_k": 5} if not filters else {}
    assert not torch.equal(bench.torch_sample(logits, uniforms.float(), bench.TEMPERATURE, **other), expected)
    assert not torch.equal(bench.torch_sample(logits, uniforms.float(), 1.0, **filters), expected)
    row = dict(shape="B1", path="split", eager_us=8.0, one_block_eager_us=30.0, graph_us=4.0, gbs=76.0,
               pct_copy_bw=2.0, torch_eager_us=80.0, speedup_vs_eager=20.0, torch_multinomial_us=40.0,
               speedup_vs_multinomial=10.0)
    table = bench.summarize([row, dict(row, path="rows", one_block_eager_us=None)]).splitlines()
    assert table[2] == "| B1 | split | 8.0 | 30.0 | 4.0 | 76 | 2% | 80.0 | 20.0 | 40.0 | 10.0 |"
    assert table[3].startswith("| B1 | rows | 8.0 | n/a | 4.0 |")


SASS_LISTING = """
        Function : census_pass_two_bf16_js
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0020*/                   MUFU.EX2 R5, R5 ;
        /*0030*/                   FADD R6, R5, R6 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   BRA 0x50;
        Function : census_stats_bf16_one_temperature
        /*0000*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0010*/                   FADD R6, R5, R6 ;
        /*0020*/              @!P0 BRA 0x0 ;
"""


def test_sass_census_parses_loops_and_checks_budgets():
    """benchmarks/sass_census.py finds each kernel's loop around its 16-byte load in a cuobjdump
    listing (not the trailing self-branch), counts per id, and --check flags a loop over budget."""
    census = load_benchmark("sass_census")
    listing = census.functions(SASS_LISTING)
    assert set(listing) == {"census_pass_two_bf16_js", "census_stats_bf16_one_temperature"}
    loop = census.main_loop(listing["census_pass_two_bf16_js"])
    assert loop == ["LDG.E.128.CONSTANT R4, desc[UR4][R2.64]", "MUFU.EX2 R5, R5", "FADD R6, R5, R6", "@!P0 BRA 0x10"]
    assert len(census.main_loop(listing["census_stats_bf16_one_temperature"])) == 3
    with pytest.raises(RuntimeError):
        census.main_loop([(0, "FADD R1, R1, R1"), (16, "BRA 0x0")])  # a loop without a 16-byte load
    rows = [dict(kernel=name, instructions_per_id=limit) for name, limit in census.BUDGETS.items()]
    assert census.over_budget(rows) == []
    rows[0]["instructions_per_id"] += 0.5
    assert len(census.over_budget(rows)) == 1 and rows[0]["kernel"] in census.over_budget(rows)[0]
    assert census.over_budget(rows[1:]) == [f"{rows[0]['kernel']}: not in the census"]


def test_sass_census_of_this_tree_is_within_budget():
    """The census itself (nvcc + cuobjdump, no GPU): every budgeted loop compiles within budget and
    the js / mkl second pass takes three SFU instructions per id, kl two, the statistics one."""
    census = load_benchmark("sass_census")
    if census.missing_tools():
        pytest.skip(f"needs {', '.join(census.missing_tools())} ({census.INSTALL_HINT})")
    rows = {r["kernel"]: r for r in census.census("90")}
    assert census.over_budget(list(rows.values())) == []
    assert rows["pass_two_bf16_js"]["sfu_per_id"] == 3.0 and rows["pass_two_bf16_kl"]["sfu_per_id"] == 2.0
    assert rows["stats_bf16_one_temperature"]["sfu_per_id"] == 1.0
    assert rows["stats_bf16_one_temperature"]["instructions_per_id_all_paths"] > rows["stats_bf16_one_temperature"]["instructions_per_id"]


def test_gpu_benchmark_coin_accepted_column():
    """The benchmark's "coin-accepted" column (positions that skip the second pass under sd / fsd) is
    the rate at which sd accepts a one-token draft with the kernels' coins; none for a filtered shape."""
    import fsd_ext

    bench = load_gpu_benchmark()
    g = torch.Generator().manual_seed(5)
    target = torch.randn(400, 2, 50, generator=g) * 2
    draft = target[:, :1] + torch.randn(400, 1, 50, generator=g)
    tokens = torch.randint(0, 50, (400, 1), generator=g)
    seed = torch.tensor(1, dtype=torch.int64)
    pct = bench.coin_accepted_pct(target, draft, tokens, seed, {})
    sd = fsd_ext.accept(target, draft, tokens, rule="sd", seed=seed, offset=0)
    assert pct == pytest.approx(100.0 * sd.num_accepted.double().mean().item())
    assert 10.0 < pct < 90.0
    assert pct != pytest.approx(bench.coin_accepted_pct(target, draft, tokens.flip(0), seed, {}))  # it can fail
    assert bench.coin_accepted_pct(target, draft, tokens, seed, {"top_p": 0.9}) is None


def test_gpu_benchmark_summary_table():
    """benchmarks/bench_accept_cuda.py's table and target verdicts (its GPU part cannot run here)."""
    bench = load_gpu_benchmark()
    row = dict(shape="B64", path="split", eager_us=50.0, graph_us=11.0, graph_steps_us=9.0, gbs=4000.0,
               pct_copy_bw=80.0, torch_eager_us=900.0, torch_compile_us=None, speedup_vs_eager=22.5,
               speedup_vs_compile=None)
    slow = dict(row, graph_us=48.0, graph_steps_us=45.0, pct_copy_bw=60.0, speedup_vs_eager=4.0)
    table, targets = bench.summarize([row, row, row])
    assert "| B64 | split | 50.0 | 11.0 / 9.0 | 4000 | 80% | 900.0 |" in table
    assert all(targets.values())
    table, targets = bench.summarize([row, row])  # a run cut short: no verdicts yet
    assert table.count("| B64 |") == 2 and targets == {}
    table, targets = bench.summarize([slow, row, slow])
    assert "| 48.0 / 45.0 | 4000 | 60% |" in table
    assert targets == {"B64 bf16 >= 80% copy BW": False, "B1 V151936 graph <= 10 us per step (1 or 10 steps per replay)": False,
                       ">= 5x eager everywhere": False}
    # The B1 verdict takes the best graph time, one or several steps per replay.
    _, targets = bench.summarize([row, row, dict(slow, graph_steps_us=9.5)])
    assert targets["B1 V151936 graph <= 10 us per step (1 or 10 steps per replay)"]
    # Launch-option variants get a second table next to the planner's times; a diagnostic row (no
    # eager baseline) prints n/a and stays out of the "everywhere" verdict.
    variant = dict(row, switch_variants={"splits=8": dict(path="split", eager_us=30.0, graph_us=29.5, graph_steps_us=25.0),
                                         "pdl=1": dict(path="split", eager_us=49.0, graph_us=10.5, graph_steps_us=8.5)})
    diagnostic = dict(row, shape="B64 greedy [diagnostic]", torch_eager_us=None, speedup_vs_eager=None)
    table, targets = bench.summarize([variant, row, row, diagnostic])
    assert "| FSD_EXT_CUDA_LAUNCH=splits=8 | FSD_EXT_CUDA_LAUNCH=pdl=1 |" in table
    assert "| B64 | split 50.0 / 11.0 / 9.0 | split 30.0 / 29.5 / 25.0 | split 49.0 / 10.5 / 8.5 |" in table
    assert "| B64 | split 50.0 / 11.0 / 9.0 | n/a | n/a |" in table
    assert "| B64 greedy [diagnostic] | split |" in table and table.count("| n/a | n/a | n/a |") == 1
    assert all(line.endswith("| n/a |") for line in table.splitlines()[2:6])  # no coin-accepted rate given
    table, _ = bench.summarize([dict(row, coin_accepted_pct=87.4)] * 3)
    assert table.splitlines()[2].endswith("| 22.5 | n/a | 87% |")
    assert all(targets.values())


def test_gpu_benchmark_times_every_opt_in_path_by_default():
    """The launcher's opt-in paths stay only while the GPU check measures each against the
    planner's choice: the benchmark's default variants name every launch option but log."""
    bench = load_gpu_benchmark()
    named = {entry.split("=")[0] for v in bench.DEFAULT_VARIANTS for entry in v.split(",")}
    assert named == {"splits", "pdl", "cluster", "reverse"} == set(bench.LAUNCH_OPTION_NAMES)


def test_decode_graphs_benchmark_runs_and_summarizes(tmp_path):
    """benchmarks/bench_decode_graphs.py: the eager part runs here on tiny models; the table with
    the graph columns (GPU only) is checked on made-up rows."""
    import importlib.util

    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_decode_graphs", ROOT / "benchmarks" / "bench_decode_graphs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--tiny", "--device", "cpu", "--rules", "ar,sd", "--batches", "2", "--prompt-len", "6",
                       "--max-new-tokens", "6", "--repeats", "1", "--out", str(tmp_path)])
    assert [(r["rule"], r["batch"]) for r in rows] == [("ar", 2), ("sd", 2)] and rows[0]["eager"] > 0
    assert (tmp_path / "bench_decode_graphs.json").exists()
    import argparse  # the comparison with HF runs only on a GPU in main(); here eagerly

    tiny = bench.random_model(bench.TINY, torch.float32, "cpu", 0)
    args = argparse.Namespace(device="cpu", prompt_len=6, max_new_tokens=6, num_draft_tokens=3, repeats=1)
    table = bench.against_hf(tiny, bench.random_model(bench.TINY, torch.float32, "cpu", 1), 512, args)
    assert table.count("\n") == 5 and "| HF assisted generation |" in table and "| 1.00x |" in table
    modes = ["eager", "graphs, first call", "graphs, reused"]
    row = {"rule": "sd", "batch": 8, "tokens per target call": 1.5, "eager": 100.0, "graphs, first call": 150.0,
           "graphs, reused": 250.0, "graphs, first call capture s": 1.25}
    assert "| sd | 8 | 1.50 | 100.0 | 150.0 | 250.0 | 2.50x | 1.25 |" in bench.summarize([row], modes)


def test_llamacpp_comparison_table():
    """bench_vs_llamacpp.py's table on made-up medians: speed ratios point the right way (a time:
    llama.cpp's over ours; a rate: ours over llama.cpp's)."""
    bench = load_benchmark("cpu_linear/bench_vs_llamacpp")
    engine = {"prefill_s": 2.0, "forward_1_s": 0.040, "forward_6_s": 0.160, "ar_decode_tok_s": 25.0, "ar_tok_s": 10.0}
    ours = {"prefill_s": 1.0, "forward_1_s": 0.050, "forward_6_s": 0.075, "ar_decode_tok_s": 20.0, "ar_tok_s": 12.5}
    summary = {"machine": {"cpu": "Test CPU"}, "args": {"threads": "2", "rounds": "3"}, "read_bandwidth_gb_s": 30.0,
               "prompt_tokens": [200], "engines": {"target/llama.cpp": engine, "target/fsd-ext": ours,
                                                   "draft/llama.cpp": dict(engine), "draft/fsd-ext": dict(ours)},
               "speculative": {"sd": {"tok_s": 15.0, "decode_tok_s": 30.0}}}
    table = bench.format_table(summary)
    assert "| prefill, 200 tokens | 2.0 s | 1.0 s | 2.00x |" in table
    assert "| 1-token forward | 40.0 ms | 50.0 ms | 0.80x |" in table
    assert "| greedy AR, end to end | 10.0 tok/s | 12.5 tok/s | 1.25x |" in table
    assert "6-token / 1-token forward (1.5B): 1.50x" in table
    assert "| SD | 15.00 | 1.20x | 1.50x |" in table


def test_compare_regimes_pairs_problems_across_runs(tmp_path, capsys):
    """benchmarks/compare_regimes.py: pooled tokens per target call over SD's per regime, seeds
    pooled per problem, only problems every named configuration (and its regime's SD) decoded; a
    missing group is named."""
    import json

    compare = load_benchmark("compare_regimes")

    def write(folder, rows):
        folder.mkdir()
        with open(folder / "results.jsonl", "w") as handle:
            for group, task, tokens, calls, passed in rows:
                handle.write(json.dumps({"group": group, "task_id": f"HumanEval/{task}", "new_tokens": tokens,
                                         "target_calls": calls, "passed": passed}) + "\n")

    write(tmp_path / "g", [("sd", 0, 40, 10, True), ("fsd", 0, 40, 8, True), ("sd", 1, 20, 5, True),
                           ("fsd", 1, 20, 5, False), ("sd", 2, 9, 1, True)]  # 2: fsd never ran it
          + [("typical", t, 10, 2, True) for t in (0, 1, 2)])
    write(tmp_path / "s", [("sd", t, 30, 10, True) for t in (0, 0, 1, 1)]
          + [("fsd", t, 30, c, True) for t, c in ((0, 10), (0, 5), (1, 10), (1, 10))])
    loaded = compare.load(str(tmp_path / "s"), {"HumanEval/0", "HumanEval/1"})
    assert loaded["fsd"]["HumanEval/0"] == (60, 15, 1.0)  # two seeds pooled
    tasks = ["HumanEval/0", "HumanEval/1"]
    greedy = compare.load(str(tmp_path / "g"), set(tasks))
    assert compare.gain(greedy["fsd"], greedy["sd"], tasks) == pytest.approx((60 / 13) / (60 / 15))
    assert compare.gain(loaded["fsd"], loaded["sd"], tasks) == pytest.approx((120 / 35) / 3)
    assert compare.pass_delta(greedy["fsd"], greedy["sd"], tasks) == -0.5
    argv = ["--greedy", str(tmp_path / "g"), "--sampled", str(tmp_path / "s"), "--ids", "0-2",
            "--greedy-sd", "sd", "--sampled-sd", "sd"]
    assert compare.main(argv + ["--pair", "fsd 2%", "fsd", "fsd"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 problems") and "| fsd 2% | 1.154 [" in out and "| -50.0 [" in out
    # Greedy pairs only: the problems of the greedy run, whatever the sampled one decoded.
    assert compare.main(argv + ["--pair", "typical 2%", "typical", "-"]) == 0
    assert capsys.readouterr().out.startswith("3 problems")
    # --versus: every other rule at a budget minus the one named, per regime.
    assert compare.main(argv + ["--pair", "fsd 2%", "fsd", "-", "--pair", "typical 2%", "typical", "-",
                                "--versus", "fsd"]) == 0
    out = capsys.readouterr().out
    assert f"typical 2% minus fsd 2%, greedy: {1.25 - (60 / 13) / 4:.3f} [" in out
    assert "; pass@1 +50.0 [" in out  # typical passed both problems, fsd one
    with pytest.raises(SystemExit, match="no group 'typical' in the sampled run"):
        compare.main(argv + ["--pair", "typical 2%", "fsd", "typical"])
