"""Property-based fuzzing of the public ops (issue 6): accept, divergence and sample on the CPU.

Every example builds one call from a hypothesis-drawn description: shapes (K = 0, V = 1, V not a
multiple of the 16-lane vector width, B up to 256), dtype, rule, divergence, filters, temperatures
(0, tiny, huge), thresholds, seeds, token dtypes, ragged num_draft, strided layouts, and logits with
extreme values (+-1e30, +inf, -inf runs, all -inf rows, NaN, subnormals, ties). Logit *values* come
from a torch generator seeded by hypothesis, so a failing example shrinks to a small description
that replays exactly.

Invariants for a valid call: every token is -1 or in [0, V); num_accepted in [0, num_draft];
tokens after the first -1 are all -1; the accepted prefix equals the drafts; valid is false exactly
for rows whose used vocabulary rows hold NaN or no finite logit (invalid rows emit nothing); the
emitted token has positive probability (its logit is not -inf) and is the argmax at temperature 0;
a strided call equals the same call on contiguous copies; the fake (meta) kernels give the same
output shapes and dtypes. For an invalid call: a ValueError,
TypeError or RuntimeError whose message names the offending argument. Never a crash or a hang
(a faulthandler watchdog ends the run with every stack if one call takes FSD_FUZZ_WATCHDOG_S).

Example counts: FSD_FUZZ_EXAMPLES (total, default 10000) and FSD_FUZZ_PROFILE (tests/_hypothesis_profiles.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os

import pytest
import torch

pytest.importorskip("hypothesis")  # in the [test] extras
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests._hypothesis_profiles import fuzz_settings  # noqa: E402

import fsd_ext  # noqa: E402
from fsd_ext import ops as fsd_ops  # noqa: E402
from fsd_ext.types import rule_spec  # noqa: E402

if fsd_ops._IMPORT_ERROR is not None:  # pragma: no cover
    pytest.skip("fsd_ext._C is not built", allow_module_level=True)

FLT_MAX = torch.finfo(torch.float32).max
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPECIALS = ("nan", "pos_inf", "neg_inf_run", "all_neg_inf", "all_pos_inf", "huge", "subnormal", "ties")
ERRORS = (ValueError, TypeError, RuntimeError)

# Temperatures / thresholds worth trying: 0, tiny (subnormal, and below float32's range), ordinary,
# huge. Floats in (0, 1e-45) round to 0 in float32 and so mean greedy.
TEMPERATURES = (0.0, 1e-45, 1e-38, 1e-30, 1e-8, 0.3, 1.0, 2.5, 1e4, 1e30)
THRESHOLDS = (0.0, 1e-7, 0.05, 0.4, 1.0, 1.5, 3.0, 50.0, math.inf)
DIV_TEMPERATURES = (1e-38, 1e-6, 0.5, 1.0, 3.0, 1e20)


# One example takes milliseconds; one that runs this long is a hang: dump every thread's stack and
# end the process (a C++ loop cannot be interrupted), so CI fails instead of stalling.
WATCHDOG_S = float(os.environ.get("FSD_FUZZ_WATCHDOG_S", "120"))


@contextlib.contextmanager
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------------------------
# Strategies.

vocab_sizes = st.one_of(st.integers(1, 40), st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 255, 257]))


@st.composite
def logits_styles(draw):
    """How to fill a logits tensor: scale of the normal values, extreme values and their rate."""
    return dict(scale=draw(st.sampled_from([1e-3, 1.0, 8.0, 1e4, 1e30])),
                specials=tuple(sorted(draw(st.frozensets(st.sampled_from(SPECIALS), max_size=3)))),
                rate=draw(st.sampled_from([0.05, 0.3, 1.0])))


def fill_logits(gen: torch.Generator, shape, dtype, style) -> torch.Tensor:
    """A contiguous logits tensor of `shape` (last dim = vocab), from `gen` and a style dict."""
    vocab = shape[-1]
    z = torch.randn(shape, generator=gen) * style["scale"]
    rows = z.view(-1, vocab)
    n = rows.shape[0]
    for special in style["specials"]:
        hit = torch.rand(n, generator=gen) < style["rate"]  # [n] rows that get this special
        col = torch.randint(vocab, (n,), generator=gen)
        idx = hit.nonzero()[:, 0]
        if special == "nan":
            rows[idx, col[idx]] = float("nan")
        elif special == "pos_inf":
            rows[idx, col[idx]] = float("inf")
        elif special == "neg_inf_run":
            start = int(torch.randint(vocab, (), generator=gen))
            length = int(torch.randint(1, vocab + 1, (), generator=gen))
            rows[idx, start:start + length] = float("-inf")
        elif special == "all_neg_inf":
            rows[idx] = float("-inf")
        elif special == "all_pos_inf":
            rows[idx] = float("inf")
        elif special == "huge":
            sign = torch.where(torch.rand(rows[idx].shape, generator=gen) < 0.5, -1.0, 1.0)
            mask = torch.rand(rows[idx].shape, generator=gen) < 0.5
            rows[idx] = torch.where(mask, sign * 1e30, rows[idx])
        elif special == "subnormal":
            rows[idx] = rows[idx] * 1e-40
        elif special == "ties":
            rows[idx] = rows[idx].round().clamp(-2, 2)
    return z.to(dtype)


LAYOUTS = ("contiguous", "pad_vocab", "transposed", "step", "expand_batch")


def with_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x [B, P, V] re-laid out with the vocab dim contiguous (values may change only for
    expand_batch, which repeats row 0). Padding holds NaN so an out-of-bounds read shows up as an
    invalid row."""
    batch, positions, vocab = x.shape
    if layout == "pad_vocab":
        buf = torch.full((batch, positions, vocab + 3), float("nan"), dtype=x.dtype)
        buf[..., :vocab] = x
        return buf[..., :vocab]
    if layout == "transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "step":
        buf = torch.full((batch, 2 * positions, vocab), float("nan"), dtype=x.dtype)
        buf[:, ::2] = x
        return buf[:, ::2]
    if layout == "expand_batch" and batch > 0:
        return x[:1].expand(batch, positions, vocab)
    return x


def row_arg(draw, gen, choices, batch):
    """A scalar from `choices`, or a [batch] float32 / float64 tensor of a few of them (drawn
    values, spread over the rows by `gen`: one hypothesis draw per row would be slow at B=256)."""
    if draw(st.booleans()):
        return draw(st.sampled_from(choices))
    values = torch.tensor(draw(st.lists(st.sampled_from(choices), min_size=1, max_size=3)), dtype=torch.float64)
    rows = values[torch.randint(len(values), (batch,), generator=gen)]
    return rows.to(draw(st.sampled_from([torch.float32, torch.float64])))


def seed_arg(draw, gen, batch):
    kind = draw(st.sampled_from(["int", "big", "per_row", "scalar_tensor"]))
    if kind == "int":
        return draw(st.integers(-(2**63), 2**63 - 1))
    if kind == "big":
        return draw(st.integers(-(2**80), 2**80))
    if kind == "per_row":
        return torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen, dtype=torch.int64)
    return torch.tensor(draw(st.integers(-(2**63), 2**63 - 1)), dtype=torch.int64)


def offset_arg(draw):
    value = draw(st.sampled_from([0, 1, 7, 2**32 + 5, 2**63 - 1]))
    return torch.tensor([value], dtype=torch.int64) if draw(st.booleans()) else value


def filter_args(draw, vocab):
    return dict(top_k=draw(st.sampled_from([None, None, 1, 2, vocab, vocab + 7])),
                top_p=draw(st.sampled_from([None, None, 1e-6, 0.5, 0.9, 1.0])),
                min_p=draw(st.sampled_from([None, None, 0.0, 1e-30, 0.1, 1.0])))


def batch_size(draw):
    return draw(st.one_of(st.integers(1, 6), st.sampled_from([0, 1, 2, 9, 33, 256])))


@st.composite
def accept_calls(draw):
    """A valid fsd_ext.accept call: (args, kwargs, layouts)."""
    batch = batch_size(draw)
    k = draw(st.one_of(st.integers(0, 4), st.sampled_from([0, 1, 7])))
    target_vocab = draw(vocab_sizes)
    if batch * (k + 1) * target_vocab > 40000:  # keep an example fast
        target_vocab = max(1, 40000 // (batch * (k + 1)))
    draft_vocab = draw(st.integers(1, target_vocab)) if draw(st.booleans()) else target_vocab
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    target = fill_logits(gen, (batch, k + 1, target_vocab), dtype, draw(logits_styles()))
    draft = fill_logits(gen, (batch, k, draft_vocab), dtype, draw(logits_styles()))

    num_draft = None
    if draw(st.booleans()):
        num_draft = torch.randint(0, k + 1, (batch,), generator=gen,
                                  dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    used = num_draft.long() if num_draft is not None else torch.full((batch,), k)
    token_mode = draw(st.sampled_from(["random", "draft_argmax", "target_argmax"]))
    if token_mode == "random" or k == 0:
        tokens = torch.randint(0, draft_vocab, (batch, k), generator=gen)
    elif token_mode == "draft_argmax":
        tokens = draft.float().nan_to_num(nan=0.0).argmax(-1)
    else:
        tokens = target[:, :k, :draft_vocab].float().nan_to_num(nan=0.0).argmax(-1)
    # Positions past num_draft may hold anything: they must be ignored.
    garbage = torch.tensor([-1, -(2**31), draft_vocab, 2**31 - 1])[torch.randint(4, (batch, k), generator=gen)]
    unused = torch.arange(k)[None, :] >= used[:, None]
    tokens = torch.where(unused, garbage, tokens).to(draw(st.sampled_from([torch.int32, torch.int64])))
    if draw(st.integers(0, 9)) == 0 and k > 1:  # non-contiguous draft tokens
        tokens = tokens.t().contiguous().t()

    rule = draw(st.sampled_from(fsd_ext.RULES))
    kwargs = dict(
        rule=rule,
        divergence=draw(st.sampled_from(fsd_ext.DIVERGENCES)),
        threshold=row_arg(draw, gen, THRESHOLDS, batch),
        temperature=row_arg(draw, gen, TEMPERATURES, batch),
        div_temperature=None if draw(st.integers(0, 3)) == 0 else row_arg(draw, gen, DIV_TEMPERATURES, batch),
        div_top_k=(draw(st.sampled_from([None, None, 1, 3, target_vocab, target_vocab + 1]))
                   if rule_spec(rule).criterion in (None, "divergence") else None),  # (refused by the others)
        num_draft=num_draft,
        seed=seed_arg(draw, gen, batch),
        offset=offset_arg(draw),
        return_divergence=draw(st.booleans()),
        **filter_args(draw, target_vocab),
    )
    layouts = (draw(st.sampled_from(LAYOUTS)) if draw(st.integers(0, 3)) == 0 else "contiguous",
               draw(st.sampled_from(LAYOUTS)) if draw(st.integers(0, 3)) == 0 else "contiguous")
    target = with_layout(target, layouts[0])
    draft = with_layout(draft, layouts[1])
    return (target, draft, tokens), kwargs


# ----------------------------------------------------------------------------------------------
# Expected properties.

def bad_vocab_rows(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return x.isnan().any(-1) | ~x.isfinite().any(-1)


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, +inf counting as FLT_MAX, lowest id on ties."""
    return logits.float().clamp(max=FLT_MAX).argmax(-1)


def per_row(value, batch) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.float()
    return torch.full((batch,), float(value)).float()


def check_accept(args, kwargs, result):
    target, draft, drafts = args
    batch, k_plus_1, target_vocab = target.shape
    k = k_plus_1 - 1
    tokens, num_accepted, valid, div = result
    assert tokens.shape == (batch, k_plus_1) and tokens.dtype == torch.int64
    assert num_accepted.shape == (batch,) and num_accepted.dtype == torch.int64
    assert valid.shape == (batch,) and valid.dtype == torch.bool
    nd = kwargs["num_draft"]
    used = nd.long() if nd is not None else torch.full((batch,), k, dtype=torch.int64)
    pos = torch.arange(k_plus_1)
    used_t = pos[None, :] <= used[:, None]
    used_d = pos[None, :k] < used[:, None]
    expect_valid = ~((bad_vocab_rows(target) & used_t).any(1) | (bad_vocab_rows(draft) & used_d).any(1))
    assert torch.equal(valid, expect_valid), (valid, expect_valid)

    # Token ranges, padding, accepted prefix.
    assert ((tokens == -1) | ((tokens >= 0) & (tokens < target_vocab))).all()
    assert (num_accepted >= 0).all() and (num_accepted <= used).all()
    padding = tokens == -1
    assert torch.equal(padding.long().cummax(1).values.bool(), padding), "a token after a -1"
    emitted = (~padding).sum(1)
    assert torch.equal(emitted, torch.where(valid, num_accepted + 1, 0)), (emitted, num_accepted, valid)
    assert (num_accepted[~valid] == 0).all()
    prefix = pos[None, :k] < num_accepted[:, None]
    assert torch.equal(torch.where(prefix, tokens[:, :k], 0), torch.where(prefix, drafts.long(), 0))

    # The emitted (correction / bonus) token has positive probability; argmax at temperature 0.
    rows = valid.nonzero()[:, 0]  # [R]
    n = num_accepted[rows]
    token = tokens[rows, n]
    at = target[rows, n].float()  # [R, V_t] the target rows the tokens were emitted from
    assert (at.gather(1, token[:, None])[:, 0] > -math.inf).all(), (rows, n, token)
    greedy = per_row(kwargs["temperature"], batch)[rows] == 0
    if kwargs["rule"] == "greedy":
        greedy[:] = True
    assert torch.equal(token[greedy], first_argmax(at[greedy])), (rows, n, token)

    if kwargs["return_divergence"]:
        assert div is not None and div.shape == (batch, k) and div.dtype == torch.float32
        live = used_d & valid[:, None]
        assert div[~live].isnan().all()
        values = div[live]
        assert not values.isnan().any(), div
        criterion = rule_spec(kwargs["rule"]).criterion
        if criterion != "lenience":  # (log(u q(d) / p(d)) may be negative)
            assert (values >= 0).all()
        bound = {"js": math.log(2), "tv": 1.0}.get(kwargs["divergence"]) if criterion in (None, "divergence") else None
        if bound is not None:
            assert (values <= bound + 1e-3).all(), values
    else:
        assert div is None


def to_meta(value):
    """Tensors (also inside tuples, lists and dicts) on the meta device."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    return value


def assert_same_meta(real, fake):
    """The fake (meta) kernel gives the real outputs' shapes and dtypes."""
    real = [real] if isinstance(real, torch.Tensor) else [t for t in real if t is not None]
    fake = [fake] if isinstance(fake, torch.Tensor) else [t for t in fake if t is not None]
    assert len(real) == len(fake)
    for r, f in zip(real, fake):
        assert f.device.type == "meta" and (r.shape, r.dtype) == (f.shape, f.dtype), (r.shape, r.dtype, f)


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


# ----------------------------------------------------------------------------------------------
# accept.

@fuzz_settings(0.55)
@given(accept_calls())
def test_fuzz_accept(call):
    args, kwargs = call
    with watchdog():
        result = fsd_ext.accept(*args, **kwargs)
    check_accept(args, kwargs, result)
    assert_same_meta(result, fsd_ext.accept(*to_meta(args), **to_meta(kwargs)))
    target, draft, drafts = args
    if not (target.is_contiguous() and draft.is_contiguous() and drafts.is_contiguous()):
        again = fsd_ext.accept(target.contiguous(), draft.contiguous(), drafts.contiguous(), **kwargs)
        assert torch.equal(result.tokens, again.tokens)
        assert torch.equal(result.num_accepted, again.num_accepted)
        assert torch.equal(result.valid, again.valid)
        if kwargs["return_divergence"]:
            assert nan_equal(result.divergence, again.divergence)


# Corruptions of a valid call: (name the message must contain, function (args, kwargs) -> None).
def _set(key, value):
    def corrupt(args, kwargs):
        kwargs[key] = value(args) if callable(value) else value
    return corrupt


def _bad_token(value):
    def corrupt(args, kwargs):
        target, draft, tokens = args
        if tokens.shape[1] == 0 or tokens.shape[0] == 0:
            raise _NotApplicable
        tokens[0, 0] = value(draft.shape[-1]) if callable(value) else value
        kwargs["num_draft"] = None
    return corrupt


class _NotApplicable(Exception):
    pass


def _replace(index, make):
    def corrupt(args, kwargs):
        args[index] = make(args)
    return corrupt


def _strided_vocab(index):
    def corrupt(args, kwargs):
        x = args[index]
        if x.shape[-1] < 2 or x.numel() == 0:  # any stride is fine on a size-1 or empty vocab dim
            raise _NotApplicable
        args[index] = torch.zeros(*x.shape[:2], 2 * x.shape[2], dtype=x.dtype)[..., ::2]
    return corrupt


def _bad_num_draft(value):
    def corrupt(args, kwargs):
        batch, k = args[2].shape
        if batch == 0:
            raise _NotApplicable
        nd = torch.zeros(batch, dtype=torch.int64)
        nd[-1] = value(k) if callable(value) else value
        kwargs["num_draft"] = nd
    return corrupt


ACCEPT_CORRUPTIONS = {
    "draft_tokens:negative": ("draft_tokens", _bad_token(-1)),
    "draft_tokens:vocab": ("draft_tokens", _bad_token(lambda v: v)),
    "draft_tokens:huge": ("draft_tokens", _bad_token(2**31 - 1)),
    "draft_tokens:float": ("draft_tokens", _replace(2, lambda a: a[2].float())),
    "draft_tokens:shape": ("draft_tokens", _replace(2, lambda a: a[2][:, :-1] if a[2].shape[1] else a[2][:, None])),
    "draft_tokens:device": ("draft_tokens", _replace(2, lambda a: a[2].to("meta"))),
    "num_draft:negative": ("num_draft", _bad_num_draft(-1)),
    "num_draft:too_big": ("num_draft", _bad_num_draft(lambda k: k + 1)),
    "num_draft:float": ("num_draft", _set("num_draft", lambda a: torch.zeros(a[0].shape[0]))),
    "num_draft:shape": ("num_draft", _set("num_draft", lambda a: torch.zeros(a[0].shape[0] + 1, dtype=torch.long))),
    "draft_logits:device": ("draft_logits", _replace(1, lambda a: a[1].to("meta"))),
    "draft_logits:dtype": ("draft_logits", _replace(1, lambda a: a[1].double())),
    "draft_logits:vocab": ("draft_logits", _replace(1, lambda a: torch.zeros(*a[1].shape[:2], a[0].shape[2] + 1, dtype=a[1].dtype))),
    "draft_logits:k": ("draft_logits", _replace(1, lambda a: torch.zeros(a[1].shape[0], a[1].shape[1] + 1, a[1].shape[2], dtype=a[1].dtype))),
    "draft_logits:strided_vocab": ("draft_logits", _strided_vocab(1)),
    "target_logits:rank": ("target_logits", _replace(0, lambda a: a[0].flatten(0, 1))),
    "target_logits:int": ("target_logits", _replace(0, lambda a: a[0].long())),
    "target_logits:strided_vocab": ("target_logits", _strided_vocab(0)),
    "target_logits:empty_vocab": ("target_logits", _replace(0, lambda a: a[0][..., :0])),
    "rule": ("rule", _set("rule", "bogus")),
    "divergence": ("divergence", _set("divergence", "l2")),
    "threshold:negative": ("threshold", _set("threshold", -0.5)),
    "threshold:nan": ("threshold", _set("threshold", math.nan)),
    "threshold:tensor_negative": ("threshold", _set("threshold", lambda a: torch.full((a[0].shape[0],), -1.0))),
    "threshold:tensor_nan": ("threshold", _set("threshold", lambda a: torch.full((a[0].shape[0],), math.nan))),
    "threshold:tensor_shape": ("threshold", _set("threshold", lambda a: torch.zeros(a[0].shape[0] + 1))),
    "threshold:tensor_int": ("threshold", _set("threshold", lambda a: torch.zeros(a[0].shape[0], dtype=torch.long))),
    "threshold:tensor_device": ("threshold", _set("threshold", lambda a: torch.zeros(a[0].shape[0], device="meta"))),
    "threshold:string": ("threshold", _set("threshold", "0.3")),
    "temperature:negative": ("temperature", _set("temperature", -1.0)),
    "temperature:nan": ("temperature", _set("temperature", math.nan)),
    "temperature:inf": ("temperature", _set("temperature", math.inf)),
    "temperature:tensor_negative": ("temperature", _set("temperature", lambda a: torch.full((a[0].shape[0],), -1e-3))),
    "temperature:tensor_nan": ("temperature", _set("temperature", lambda a: torch.full((a[0].shape[0],), math.nan))),
    "temperature:tensor_inf": ("temperature", _set("temperature", lambda a: torch.full((a[0].shape[0],), math.inf))),
    "div_temperature:zero": ("div_temperature", _set("div_temperature", 0.0)),
    "div_temperature:inf": ("div_temperature", _set("div_temperature", math.inf)),
    "div_temperature:tensor_zero": ("div_temperature", _set("div_temperature", lambda a: torch.zeros(a[0].shape[0]))),
    "div_temperature:tensor_nan": ("div_temperature", _set("div_temperature", lambda a: torch.full((a[0].shape[0],), math.nan))),
    "top_k:zero": ("top_k", _set("top_k", 0)),
    "top_k:float": ("top_k", _set("top_k", 2.5)),
    "top_k:huge": ("top_k", _set("top_k", 2**70)),
    "top_p:zero": ("top_p", _set("top_p", 0.0)),
    "top_p:big": ("top_p", _set("top_p", 1.5)),
    "top_p:nan": ("top_p", _set("top_p", math.nan)),
    "min_p:negative": ("min_p", _set("min_p", -0.1)),
    "min_p:nan": ("min_p", _set("min_p", math.nan)),
    "div_top_k:zero": ("div_top_k", _set("div_top_k", 0)),
    "div_top_k:huge": ("div_top_k", _set("div_top_k", 2**70)),
    "seed:float": ("seed", _set("seed", 1.5)),
    "seed:int32_tensor": ("seed", _set("seed", lambda a: torch.zeros(a[0].shape[0], dtype=torch.int32))),
    "seed:shape": ("seed", _set("seed", lambda a: torch.zeros(a[0].shape[0] + 1, dtype=torch.int64))),
    "seed:device": ("seed", _set("seed", torch.zeros((), dtype=torch.int64, device="meta"))),
    "offset:negative": ("offset", _set("offset", -1)),
    "offset:huge": ("offset", _set("offset", 2**64)),
    "offset:tensor_shape": ("offset", _set("offset", torch.zeros(2, dtype=torch.int64))),
}


@fuzz_settings(0.1)
@given(accept_calls(), st.sampled_from(sorted(ACCEPT_CORRUPTIONS)))
def test_fuzz_accept_rejects_bad_arguments(call, corruption):
    args, kwargs = call
    args = [a.clone() if i == 2 else a for i, a in enumerate(args)]
    name, corrupt = ACCEPT_CORRUPTIONS[corruption]
    if args[0].shape[0] == 0 and corruption.partition(":")[2] in ("tensor_negative", "tensor_nan", "tensor_inf", "tensor_zero"):
        return  # a bad per-row value needs a row
    try:
        corrupt(args, kwargs)
    except _NotApplicable:
        return
    with pytest.raises(ERRORS) as info, watchdog():
        fsd_ext.accept(*args, **kwargs)
    assert name in str(info.value), (corruption, str(info.value))


# ----------------------------------------------------------------------------------------------
# divergence.

@st.composite
def divergence_calls(draw):
    rank = draw(st.integers(1, 3))
    lead = tuple(draw(st.lists(st.integers(0, 5), min_size=rank - 1, max_size=rank - 1)))
    if draw(st.integers(0, 9)) == 0:
        lead = (256,) if rank == 2 else lead
    target_vocab = draw(vocab_sizes)
    draft_vocab = draw(st.integers(1, target_vocab)) if draw(st.booleans()) else target_vocab
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    target = fill_logits(gen, lead + (target_vocab,), dtype, draw(logits_styles()))
    draft = fill_logits(gen, lead + (draft_vocab,), dtype, draw(logits_styles()))
    if draw(st.integers(0, 3)) == 0 and rank >= 2:
        buf = torch.full(lead + (target_vocab + 5,), float("nan"), dtype=dtype)
        buf[..., :target_vocab] = target
        target = buf[..., :target_vocab]
    kwargs = dict(kind=draw(st.sampled_from(fsd_ext.DIVERGENCES)),
                  temperature=draw(st.sampled_from(DIV_TEMPERATURES)),
                  top_k=draw(st.sampled_from([None, None, 1, 2, target_vocab, target_vocab + 3])))
    return (target, draft), kwargs


@fuzz_settings(0.15)
@given(divergence_calls())
def test_fuzz_divergence(call):
    (target, draft), kwargs = call
    with watchdog():
        out = fsd_ext.divergence(target, draft, **kwargs)
    assert_same_meta(out, fsd_ext.divergence(target.to("meta"), draft.to("meta"), **kwargs))
    assert out.shape == target.shape[:-1] and out.dtype == torch.float32
    bad = bad_vocab_rows(target) | bad_vocab_rows(draft)
    assert torch.equal(out.isnan(), bad), (out, bad)
    values = out[~bad]
    assert (values >= 0).all()
    bound = {"js": math.log(2), "tv": 1.0}.get(kwargs["kind"])
    if bound is not None:
        assert (values <= bound + 1e-3).all(), values


# ----------------------------------------------------------------------------------------------
# sample.

@st.composite
def sample_calls(draw):
    rank = draw(st.integers(1, 3))
    if rank == 1:
        shape, batch = (), 1
    else:
        batch = batch_size(draw)
        shape = (batch,) if rank == 2 else (batch, draw(st.integers(0, 4)))
    vocab = draw(vocab_sizes)
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    logits = fill_logits(gen, shape + (vocab,), dtype, draw(logits_styles()))
    if rank == 3 and draw(st.integers(0, 3)) == 0:
        logits = with_layout(logits, draw(st.sampled_from(LAYOUTS)))
    temperature = row_arg(draw, gen, TEMPERATURES, batch) if rank > 1 else draw(st.sampled_from(TEMPERATURES))
    kwargs = dict(temperature=temperature, seed=seed_arg(draw, gen, batch), offset=offset_arg(draw),
                  **filter_args(draw, vocab))
    return logits, kwargs


@fuzz_settings(0.2)
@given(sample_calls())
def test_fuzz_sample(call):
    logits, kwargs = call
    with watchdog():
        tokens = fsd_ext.sample(logits, **kwargs)
    assert_same_meta(tokens, fsd_ext.sample(logits.to("meta"), **to_meta(kwargs)))
    vocab = logits.shape[-1]
    assert tokens.shape == logits.shape[:-1] and tokens.dtype == torch.int64
    bad = bad_vocab_rows(logits)
    assert torch.equal(tokens == -1, bad), (tokens, bad)
    assert ((tokens == -1) | ((tokens >= 0) & (tokens < vocab))).all()
    rows = logits.reshape(-1, vocab)
    flat = tokens.reshape(-1)
    tau = kwargs["temperature"]
    batch = logits.shape[0] if logits.dim() > 1 else 1
    per_position = rows.shape[0] // batch if batch else 0
    tau_rows = per_row(tau, batch).repeat_interleave(per_position) if batch else torch.zeros(0)
    good = ~bad.reshape(-1)
    picked = rows[good].float().gather(1, flat[good][:, None])[:, 0]
    assert (picked > -math.inf).all()
    greedy = good & (tau_rows == 0)
    assert torch.equal(flat[greedy], first_argmax(rows[greedy]))
    if logits.dim() == 3 and not logits.is_contiguous():
        assert torch.equal(tokens, fsd_ext.sample(logits.contiguous(), **kwargs))


# Other ops' argument errors: (call, name the message must contain).
_Z = torch.zeros(2, 5)
OTHER_ERRORS = {
    "divergence:draft_vocab": (lambda: fsd_ext.divergence(_Z[:, :3], _Z), "draft_logits"),
    "divergence:lead": (lambda: fsd_ext.divergence(_Z, torch.zeros(3, 5)), "draft_logits"),
    "divergence:temperature_inf": (lambda: fsd_ext.divergence(_Z, _Z, temperature=math.inf), "temperature"),
    "divergence:temperature_zero": (lambda: fsd_ext.divergence(_Z, _Z, temperature=0.0), "temperature"),
    "divergence:kind": (lambda: fsd_ext.divergence(_Z, _Z, kind="l1"), "kind"),
    "divergence:top_k": (lambda: fsd_ext.divergence(_Z, _Z, top_k=0), "top_k"),
    "divergence:dtype": (lambda: fsd_ext.divergence(_Z.double(), _Z.double()), "target_logits"),
    "divergence:device": (lambda: fsd_ext.divergence(_Z, _Z.to("meta")), "draft_logits"),
    "sample:rank": (lambda: fsd_ext.sample(torch.zeros(1, 1, 1, 5)), "logits"),
    "sample:strided": (lambda: fsd_ext.sample(_Z[:, ::2]), "logits"),
    "sample:temperature_nan": (lambda: fsd_ext.sample(_Z, temperature=math.nan), "temperature"),
    "sample:temperature_inf": (lambda: fsd_ext.sample(_Z, temperature=1e300), "temperature"),
    "sample:temperature_tensor_negative": (lambda: fsd_ext.sample(_Z, temperature=torch.tensor([1.0, -1.0])), "temperature"),
    "sample:temperature_tensor_inf": (lambda: fsd_ext.sample(_Z, temperature=torch.tensor([1.0, math.inf])), "temperature"),
    "sample:temperature_shape": (lambda: fsd_ext.sample(_Z, temperature=torch.ones(3)), "temperature"),
    "sample:seed_shape": (lambda: fsd_ext.sample(_Z, seed=torch.zeros(3, dtype=torch.long)), "seed"),
    "sample:top_p": (lambda: fsd_ext.sample(_Z, top_p=0.0), "top_p"),
    "sample:offset": (lambda: fsd_ext.sample(_Z, offset=2**64), "offset"),
    "uniforms:purpose": (lambda: fsd_ext.philox_uniforms(0, 0, 2, 2, purpose="x"), "purpose"),
    "uniforms:rows": (lambda: fsd_ext.philox_uniforms(0, 0, -1, 2), "rows"),
    "uniforms:positions": (lambda: fsd_ext.philox_uniforms(0, 0, 2, 2**25), "positions"),
    "uniforms:offset": (lambda: fsd_ext.philox_uniforms(0, 2**64, 2, 2), "offset"),
    "uniforms:seed_shape": (lambda: fsd_ext.philox_uniforms(torch.zeros(3, dtype=torch.long), 0, 2, 2), "seed"),
}


@pytest.mark.parametrize("case", sorted(OTHER_ERRORS))
def test_other_ops_reject_bad_arguments(case):
    call, name = OTHER_ERRORS[case]
    with pytest.raises(ERRORS) as info:
        call()
    assert name in str(info.value), str(info.value)


# ----------------------------------------------------------------------------------------------
# Regressions: the minimal failing inputs the fuzzer found (one test per defect).

def test_regression_empty_batch_with_zero_strides():
    """torch.randn(0, 1, 1) * 2 has strides (1, 0, 0): contiguous to torch, rejected before."""
    target, draft = torch.randn(0, 1, 1) * 2, torch.randn(0, 0, 1) * 2
    assert target.stride(-1) == 0
    res = fsd_ext.accept(target, draft, torch.zeros(0, 0, dtype=torch.int32), seed=0)
    assert res.tokens.shape == (0, 1) and res.valid.shape == (0,)
    assert fsd_ext.sample(torch.randn(2, 0, 3) * 2, seed=0).shape == (2, 0)


def test_regression_size1_vocab_any_stride():
    """A V=1 slice x[..., ::2] has stride(-1) == 2, which a size-1 dim may have (torch ignores
    strides of size-1 dims); it was rejected as non-contiguous. With V=1 every token is 0."""
    target = torch.randn(2, 3, 2)[..., ::2]
    draft = torch.randn(2, 2, 2)[..., ::2]
    assert target.stride(-1) == 2
    res = fsd_ext.accept(target, draft, torch.zeros(2, 2, dtype=torch.long), seed=0)
    assert torch.equal(res.tokens, torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(fsd_ext.sample(target, seed=0), torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(fsd_ext.divergence(target, draft[:, :1].expand(2, 3, 1)), torch.zeros(2, 3))


@pytest.mark.parametrize("where", ["temperature", "div_temperature", "temperature_tensor", "float32_overflow"])
def test_regression_infinite_temperature_rejected(where):
    """temperature=inf made (z - max) / tau NaN at -inf logits: a drafted token of probability 0
    (logit -inf) was accepted, and NaN reached std::sort in the filters (undefined behaviour)."""
    target = torch.tensor([[[0.0, -math.inf, 1.0, 2.0]] * 2])
    draft = target[:, :1].clone()
    kwargs = {"temperature": dict(temperature=math.inf),
              "div_temperature": dict(div_temperature=math.inf, div_top_k=2),
              "temperature_tensor": dict(temperature=torch.tensor([math.inf]), top_p=0.5),
              "float32_overflow": dict(temperature=1e300)}[where]
    with pytest.raises(ERRORS, match="temperature"):
        fsd_ext.accept(target, draft, torch.tensor([[1]]), seed=0, **kwargs)
    # The op itself (no front end) rejects it as well: it holds the range checks (a ValueError, as
    # from the front end); a per-row value too, by the CPU binding.
    with pytest.raises(ValueError, match="temperature"):
        torch.ops.fsd_ext.sample(target, None, math.inf, 0, 1.0, 0.0, None, 0, False, None, 0)
    with pytest.raises(ValueError, match="temperature"):
        torch.ops.fsd_ext.sample(target, torch.tensor([math.inf]), 1.0, 0, 1.0, 0.0, None, 0, False, None, 0)


def test_regression_sample_empty_batch():
    """fsd_ext.sample reshaped [0, V] logits with -1 and raised 'cannot reshape tensor of 0 elements'."""
    assert fsd_ext.sample(torch.randn(0, 5), seed=0).shape == (0,)
    assert fsd_ext.sample(torch.randn(0, 3, 5), seed=0).shape == (0, 3)
    strided = torch.randn(4, 10)[:, :5]  # a [B, V] view with a row stride stays a view
    assert torch.equal(fsd_ext.sample(strided, temperature=0.0, seed=0), strided.argmax(-1))


def test_regression_offset_overflow_named():
    """philox_uniforms(offset=2**64) raised 'Overflow when unpacking long long'."""
    with pytest.raises(ValueError, match="offset"):
        fsd_ext.philox_uniforms(0, 2**64, 2, 2)


def test_regression_draft_vocab_error_names_argument():
    with pytest.raises(ValueError, match="draft_logits"):
        fsd_ext.accept(torch.zeros(1, 2, 1), torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long))
