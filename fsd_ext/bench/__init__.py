"""The evaluation harness, apart from the library: `import fsd_ext` never loads it.

The accuracy/speed frontier of FSD and the other lenient rules on a real model pair: pass@1 on
HumanEval (or GSM8K, `--task gsm8k`) against tokens/s and tokens per target call (`fsd-ext bench
frontier`, benchmarks/frontier.py).

For every configuration (AR; SD; FSD and FSD-strict for each divergence over a threshold grid; the
other lenient rules over theirs; greedy by default, sampling with several seeds on request) each
selected problem is decoded once per seed (alone, or `--batch-size` at a time for an accuracy run),
the completion is scored (tasks.py: HumanEval in a sandbox, GSM8K by its final number), and one JSON line
is appended to `results.jsonl`, keyed by (setup, configuration, seed, problem). A stopped run
continues where it left off. The summary aggregates per configuration (seeds pooled):

    pass_at_1              mean over problems of (passing samples / samples)
    pass_at_1_seed_min/max the spread over seeds: the lowest and highest one seed's pass@1
    tokens_per_s           generated tokens / seconds inside generate (summed over problems; the
                           prompt forwards included, so short completions on a CPU are dominated
                           by them)
    decode_tokens_per_s    the same without the prompt forwards, when generate reports
                           `stats.prefill_seconds`, and without CUDA graph captures
                           (`stats.capture_seconds`, once per generate call and shape)
    mean_accepted          accepted drafts / verification steps (the correction or bonus token is
                           not counted; 0 for AR)
    tokens_per_target_call generated tokens / target forward calls
    mean_drafted           drafts proposed / verification steps (below K under an adaptive
                           draft_length)
    draft_cost_ratio       a draft forward's time over a target verification's, prompt forwards
                           left out (GenerateStats.draft_cost_ratio, pooled)
    ceiling_tokens_per_s   the tokens/s had every step accepted all the drafts it proposed, from the
                           same run's prompt, verification, draft and loop times: what no
                           acceptance rule can beat at this draft length
    sd_rejected_share      accepted drafts that SD alone would have rejected / accepted drafts
    same_as_sd             greedy: share of problems whose text equals fixed-K SD's
    pass_delta_ci_low/high the paired 95% bootstrap interval of pass@1 minus SD's (same regime)
    projected_vs_sd_*      the speed-up over SD under four cost models (docs/generate.md)
    target_calls, draft_calls, target_s, draft_s, wall_s (generate plus scoring)

"SD alone would have rejected" (0 by definition for AR and SD) comes from fsd_ext.generate's
`stats.sd_rejected_accepted`. Under greedy decoding SD accepts a draft exactly when it equals the
target's argmax, so generate counts the accepted drafts that are not. Under sampling the FSD rows
pass `output_divergences=True`: generate replays each step's coins and counts the accepted drafts
whose coin fails SD's test u q(d) <= p(d), timed apart and left out of tokens/s. A generate
function without that statistic leaves the column empty.

Outputs in --out: results.jsonl, summary.csv, summary.json (setup, machine, versions, command),
frontier.png (pass@1 vs tokens/s with the Pareto frontier, AR and SD marked),
pass_vs_accepted.png, threshold_vs_acceptance.png and rules_frontier.png.

Modules, in the order a run uses them: grid.py (configurations), tasks.py over humaneval.py and
gsm8k.py (problems, prompts, scoring), runner.py (the Backend interface, HFBackend over fsd_ext.generate, the sweep),
store.py (results.jsonl, runs.jsonl), summary.py (rows, table, CSV/JSON), plots.py, env.py
(machine and versions), cli.py (arguments and the run).
"""
