"""The two SFT loss routes against `torch.nn.functional.cross_entropy` on dense logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln_train.errors import KilnError, TrainingFailure
from kiln_train.ground.backend import FULL_LOGITS, KT_TAPE_FLCE
from kiln_train.plan.formulas import vocab_chunk_size
from kiln_train.train.loss import ChunkedLinearCrossEntropy, count_supervised_targets, sft_loss

ROUTES = (KT_TAPE_FLCE, FULL_LOGITS)


def make_case(t: int, d: int, v: int, dtype: torch.dtype, *, seed: int = 0, supervised=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    if supervised is None:
        supervised = torch.rand(t, generator=g) < 0.5
        supervised[-1] = True  # at least one target
    labels = torch.where(torch.as_tensor(supervised), labels, torch.full_like(labels, -100))
    return hidden, weight, labels


def dense_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """Loss and hidden gradient from dense logits and the standard cross-entropy."""
    h = hidden.detach().clone().requires_grad_(True)
    logits = h @ weight.t()
    loss = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad


def route_loss_and_grad(route: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    h = hidden.detach().clone().requires_grad_(True)
    loss = sft_loss(route, h, weight, labels)
    loss.backward()
    return loss.detach(), h.grad


@pytest.mark.parametrize("route", ROUTES)
def test_f64_matches_dense_cross_entropy(route):
    # vocab 10_000 is not a multiple of the 4096 chunk: the last chunk is partial.
    hidden, weight, labels = make_case(24, 16, 10_000, torch.float64)
    ref_loss, ref_grad = dense_reference(hidden, weight, labels)
    loss, grad = route_loss_and_grad(route, hidden, weight, labels)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - ref_loss.item()) < 1e-10
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-10)
    assert grad.dtype == torch.float64


@pytest.mark.parametrize("route", ROUTES)
def test_f32_matches_dense_cross_entropy(route):
    hidden, weight, labels = make_case(40, 32, 9_001, torch.float32, seed=1)
    ref_loss, ref_grad = dense_reference(hidden.double(), weight.double(), labels)
    loss, grad = route_loss_and_grad(route, hidden, weight, labels)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    scale = ref_grad.abs().max().item()
    # 32 f32 ulps of the largest gradient: the softmax sums 9,001 terms, whose rounding depends on
    # the CPU's vector width (AVX2 and AVX-512 machines land on either side of 8 ulps).
    assert (grad.double() - ref_grad).abs().max().item() <= 32 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("route", ROUTES)
def test_bf16_hidden_close_to_f32_reference(route):
    """bf16 inputs: f32 accumulation keeps the loss within bf16 input rounding of the f32 value.

    The bf16 route sees bf16-rounded inputs (relative error <= 2^-8 per element); the loss and the
    gradient are computed in f32 from those inputs, so the gap to the f32 reference *on the same
    rounded inputs* is f32-sized (the loss is returned in f32) and the hidden gradient differs
    only by its final rounding to bf16 (relative 2^-8 of the largest entry).
    """
    hidden, weight, labels = make_case(32, 64, 5_000, torch.bfloat16, seed=2)
    ref_loss, ref_grad = dense_reference(hidden.double(), weight.double(), labels)
    loss, grad = route_loss_and_grad(route, hidden, weight, labels)
    assert grad.dtype == torch.bfloat16
    if route == KT_TAPE_FLCE:
        assert loss.dtype == torch.float32
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    else:
        # Dense bf16 logits are rounded before the f32 cross-entropy: error ~2^-8 of a logit.
        assert abs(loss.item() - ref_loss.item()) <= 2e-2
    scale = ref_grad.abs().max().item()
    tol = 2**-8 if route == KT_TAPE_FLCE else 2**-5
    assert (grad.double() - ref_grad).abs().max().item() <= tol * scale


def test_routes_agree_on_scattered_supervision():
    t = 64
    supervised = torch.zeros(t, dtype=torch.bool)
    supervised[[3, 4, 17, 30, 31, 32, 60]] = True
    hidden, weight, labels = make_case(t, 24, 4097, torch.float64, seed=3, supervised=supervised)
    a_loss, a_grad = route_loss_and_grad(KT_TAPE_FLCE, hidden, weight, labels)
    b_loss, b_grad = route_loss_and_grad(FULL_LOGITS, hidden, weight, labels)
    assert abs(a_loss.item() - b_loss.item()) < 1e-12
    assert torch.allclose(a_grad, b_grad, atol=1e-12, rtol=0)
    # Rows whose next token is unsupervised get exactly zero gradient (including the last row).
    rows_with_target = {2, 3, 16, 29, 30, 31, 59}
    for row in range(t):
        if row not in rows_with_target:
            assert torch.count_nonzero(a_grad[row]) == 0
        else:
            assert torch.count_nonzero(a_grad[row]) > 0


@pytest.mark.parametrize("route", ROUTES)
def test_minimal_two_token_row(route):
    hidden, weight, labels = make_case(2, 8, 50, torch.float64, seed=4, supervised=[False, True])
    loss, grad = route_loss_and_grad(route, hidden, weight, labels)
    expected = torch.logsumexp(hidden[0] @ weight.t(), 0) - hidden[0] @ weight[labels[1]]
    assert abs(loss.item() - expected.item()) < 1e-12
    assert torch.count_nonzero(grad[1]) == 0


@pytest.mark.parametrize("route", ROUTES)
def test_batched_hidden_shape_is_accepted(route):
    hidden, weight, labels = make_case(12, 8, 100, torch.float64, seed=5)
    flat = sft_loss(route, hidden, weight, labels)
    batched = sft_loss(route, hidden.unsqueeze(0), weight, labels.unsqueeze(0))
    assert flat.item() == pytest.approx(batched.item(), abs=1e-14)


@pytest.mark.parametrize("route", ROUTES)
def test_head_never_gets_a_gradient(route):
    hidden, weight, labels = make_case(16, 8, 300, torch.float32, seed=6)
    frozen = weight.clone()
    trainable_looking = weight.clone().requires_grad_(True)  # the route still treats it as a constant
    for w in (frozen, trainable_looking):
        h = hidden.clone().requires_grad_(True)
        sft_loss(route, h, w, labels).backward()
        assert w.grad is None
        assert h.grad is not None


def test_chunked_function_returns_no_weight_gradient():
    hidden, weight, labels = make_case(10, 8, 300, torch.float32, seed=7)
    w = weight.clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    targets = labels[1:].clamp(min=0)
    loss = ChunkedLinearCrossEntropy.apply(h[:-1], w, targets, 64, True)
    loss.backward()
    assert w.grad is None
    assert h.grad.abs().sum() > 0


def test_no_gradient_mode_still_computes_the_loss():
    hidden, weight, labels = make_case(16, 8, 300, torch.float64, seed=8)
    ref_loss, _ = dense_reference(hidden, weight, labels)
    with torch.no_grad():
        loss = sft_loss(KT_TAPE_FLCE, hidden, weight, labels)
    assert abs(loss.item() - ref_loss.item()) < 1e-12


@pytest.mark.parametrize("route", ROUTES)
def test_no_supervised_target_is_an_error(route):
    hidden, weight, _ = make_case(8, 4, 20, torch.float32)
    labels = torch.full((8,), -100)
    labels[0] = 5  # the first token is never a target: nothing predicts it
    with pytest.raises(TrainingFailure) as err:
        sft_loss(route, hidden, weight, labels)
    assert err.value.reason == "zero_action_tokens"


def test_unknown_route_is_rejected():
    hidden, weight, labels = make_case(8, 4, 20, torch.float32)
    with pytest.raises(KilnError) as err:
        sft_loss("vulkan_active_rows", hidden, weight, labels)
    assert err.value.code == "training_invalid_request"


def test_label_outside_vocabulary_is_rejected():
    hidden, weight, labels = make_case(8, 4, 20, torch.float32)
    labels[3] = 20
    with pytest.raises(TrainingFailure) as err:
        sft_loss(KT_TAPE_FLCE, hidden, weight, labels)
    assert err.value.reason == "data_schema_error"


def test_shape_mismatch_is_rejected():
    hidden, weight, labels = make_case(8, 4, 20, torch.float32)
    with pytest.raises(TrainingFailure) as err:
        sft_loss(KT_TAPE_FLCE, hidden, weight, labels[:-1])
    assert err.value.reason == "shape_mismatch"


def test_count_supervised_targets():
    assert count_supervised_targets(torch.tensor([5, -100, 7, 8])) == 2
    assert count_supervised_targets([5, 6, -100]) == 1  # labels[0] is never a target
    assert count_supervised_targets(torch.tensor([1])) == 0
    assert count_supervised_targets(torch.tensor([[5, 6, 7]])) == 2


def test_vocab_chunk_is_bounded():
    assert vocab_chunk_size(248_320, 10) == 4096
    assert vocab_chunk_size(1000, 10) == 1000
    # Very many supervised rows shrink the chunk so [A, chunk] f32 stays inside the scratch budget.
    assert vocab_chunk_size(248_320, 1_000_000) < 4096
    assert vocab_chunk_size(248_320, 10**12) >= 1
