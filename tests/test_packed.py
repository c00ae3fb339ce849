"""Packed documents and padded rows (issue #47): a tiny Hugging Face Qwen2 (and Mistral's sliding window, gpt-oss's
sinks) and the example GPT (through ``packed_documents``) trained on rows of several documents, positions restarting
at each, with and without -100 labels at the boundaries, and on right-padded rows: every layout in parity with one
process on the same global batch, under the ring, the all-gather, Ulysses and the hybrid.
"""

from __future__ import annotations

import pytest
import torch
from launch import launch
from packed_workers import STEPS, WORLD2, WORLD4, packed_rows, references, weight_diffs, world2, world4
from workers import assert_parity

from lightning_par import packed_documents


@pytest.fixture(scope="module")
def reference():
    return references()


@pytest.fixture(scope="module")
def runs2():
    return launch(2, world2)[0]


@pytest.fixture(scope="module")
def runs4():
    return launch(4, world4)[0]


def _key(case: tuple) -> tuple:
    _, _, rows, gpt, kw = case
    return rows, gpt, tuple(sorted(kw.items()))


def _assert_parity(result: dict, reference: dict) -> None:
    worst = max(weight_diffs(result, reference).items(), key=lambda item: item[1])
    assert worst[1] <= 1e-5, f"weights differ most in {worst[0]}: {worst[1]:.2e}"
    assert_parity(result, reference, steps=STEPS)


@pytest.mark.parametrize("name", list(WORLD2))
def test_packed_rows_world2(runs2, reference, name):
    _assert_parity(runs2[name], reference[_key(WORLD2[name])])


@pytest.mark.parametrize("name", list(WORLD4))
def test_packed_rows_world4(runs4, reference, name):
    _assert_parity(runs4[name], reference[_key(WORLD4[name])])


def test_documents_change_the_result(reference):
    """The references differ with and without the boundaries' -100 labels, and packed rows differ from the same
    tokens as one document: the tests above would catch attention that crossed documents."""
    qwen = {rows: reference[(rows, False, ())]["losses"] for rows in ("packed", "packed_masked")}
    assert max(abs(a - b) for a, b in zip(qwen["packed"], qwen["packed_masked"])) > 1e-3
    restarts = sum(int((row["position_ids"] == 0).sum()) - 1 for row in packed_rows(32, False))
    assert restarts >= 24, f"the rows hold several documents ({restarts} restarts in 32 rows)"


def test_ulysses_refuses_heads_it_cannot_split(runs2):
    message = runs2["errors"]["heads_not_divisible"]
    assert message and "3 query heads" in message and "cp_algorithm='ring'" in message


def test_traced_pipeline_stages_refuse_the_rows_tables(runs2):
    message = runs2["errors"]["rows_through_traced_stages"]
    assert message and "forward got ['position_ids']" in message and "Hugging Face model's" in message


def test_packed_documents_in_one_process_masks_across_documents():
    """One process: ``packed_documents`` gives SDPA the documents' mask (each document alone equals its part of
    the packed row), padding hidden as keys."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with packed_documents(positions):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for part in (slice(0, 3), slice(3, 6)):
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part],
                                                                is_causal=True)
        torch.testing.assert_close(out[:, :, part], alone)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    with packed_documents(attention_mask=mask):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    first = torch.nn.functional.scaled_dot_product_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], is_causal=True)
    torch.testing.assert_close(out[:, :, :4], first)
    with pytest.raises(ValueError, match="passes an attn_mask of its own"), packed_documents(positions):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool))
