"""Parity with the transformers reference (`transformers.models.minimax_m3_vl`), through golden fixtures.

`tests/fixtures/make_reference_fixtures.py` saved tiny random models with `save_pretrained` (text-only
`MiniMaxM3VLForCausalLM` and the VL wrapper, which writes the released MiniMax tensor layout) and the
reference's fp32 logits and MSA block selections. Our loader reads the same directories.
"""

from pathlib import Path

import numpy as np
import pytest

from m3jax import load_model

FIXTURES = Path(__file__).parent / "fixtures"


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module", params=["text_tiny", "vl_tiny"])
def case(request):
    path = FIXTURES / request.param
    ref = dict(np.load(path / "reference.npz"))
    return load_model(path, dtype="float32"), ref


def test_logits_match_reference(case):
    model, ref = case
    got = model.logits(ref["input_ids"])
    assert got.shape == ref["logits"].shape
    assert _rel_err(got, ref["logits"]) < 1e-4


def test_block_selections_match_reference(case):
    model, ref = case
    sel = model.block_selections(ref["input_ids"])
    ref_layers = sorted(int(k.removeprefix("selection_layer")) for k in ref if k.startswith("selection_layer"))
    assert sorted(sel) == ref_layers and ref_layers
    dropped = 0
    for layer in ref_layers:
        want = ref[f"selection_layer{layer}"]  # [B, K, S, min(topk, blocks)]
        got = sel[layer][..., : want.shape[-1]]
        assert (sel[layer][..., want.shape[-1]:] == -1).all()
        # Top-k order is not part of the contract (only the set of blocks is): compare sorted.
        np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1), err_msg=f"layer {layer}")
        nvis = ref["input_ids"].shape[1] // model.cfg.index_block_size
        dropped += int((want >= 0).sum(-1)[..., -1].min() < nvis)
    assert dropped, "the fixture must be long enough that selection drops blocks"
