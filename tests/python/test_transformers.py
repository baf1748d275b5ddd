"""mha as Hugging Face transformers' attention implementation "mha" (mha.integrations.transformers),
on tiny models built from configs with random weights (no downloads) of the families whose
attention differs: BERT (bidirectional, padding), GPT-2, Llama (GQA), Mistral (sliding window),
Gemma 2 (softcap, windows), gpt-oss (sinks, windows), Qwen3 (QK-norm inside the model), T5
(a relative position bias added to the scores).

Accuracy bound: against the same model run by transformers' "eager" attention in float64, mha's
float32 error must be within 2x that of transformers' own float32 implementation ("sdpa", or
"eager" for the models sdpa refuses: Gemma 2's softcap, gpt-oss's sinks) plus 1e-6.
"""
import warnings

import pytest
import torch

import mha
import mha.integrations.transformers as mt

# scripts/py-env.sh installs transformers: a missing one fails here, never skips.
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig, BertModel, Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, GptOssConfig,
    GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config,
    Qwen3ForCausalLM, T5Config, T5Model)
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

VOCAB = 101
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0)


def _config(family):
    if family == "bert":
        return BertModel, BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    if family == "gpt2":
        return GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaForCausalLM, LlamaConfig(**_DECODER)
    if family == "mistral":
        return MistralForCausalLM, MistralConfig(**_DECODER, sliding_window=12)
    if family == "gemma2":
        return Gemma2ForCausalLM, Gemma2Config(**_DECODER, sliding_window=12, attn_logit_softcapping=4.0,
                                               query_pre_attn_scalar=16)
    if family == "gpt_oss":
        cfg = dict(_DECODER, intermediate_size=64)
        return GptOssForCausalLM, GptOssConfig(**cfg, sliding_window=12, num_local_experts=4,
                                               num_experts_per_tok=2)
    if family == "qwen3":
        return Qwen3ForCausalLM, Qwen3Config(**_DECODER)
    raise ValueError(family)


FAMILIES = ["bert", "gpt2", "llama", "mistral", "gemma2", "gpt_oss", "qwen3"]
# Padding side: absolute position embeddings (BERT, GPT-2) count from the first token, so a
# left-padded sequence would not equal itself alone; rotary ones are relative.
_RIGHT_PADDED = ("bert", "gpt2")
# transformers' sdpa refuses softcap and sinks: those models' own float32 reference is "eager".
_BASELINE = {"gemma2": "eager", "gpt_oss": "eager"}


def _model(family, implementation, dtype=torch.float32, seed=0):
    cls, config = _config(family)
    torch.manual_seed(seed)
    model = cls(config).eval()
    if family == "gpt_oss":  # random sinks of either sign (the init leaves them at ~0)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    model.set_attn_implementation(implementation)
    if family == "gpt_oss":
        model.config._experts_implementation = "eager"  # torch's grouped_mm has no float64
    return model.to(dtype)


def _inputs(batch=2, length=40, pad=(0, 7), left=True, seed=1):
    """Random tokens with a padding mask: sequence b has pad[b] padding tokens on the left (or right)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, n in enumerate(pad):
        if n:
            if left:
                mask[b, :n] = 0
            else:
                mask[b, length - n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _output(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    x = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return x.double().masked_fill(mask[..., None] == 0, 0.0)  # padding positions are not compared (sdpa: NaN)


def _reference(family, ids, mask, implementation="eager", dtype=torch.float64):
    """Each sequence run alone without its padding (transformers' eager float64 turns a padded
    batch into NaN: fully masked padding rows), at the batch's positions."""
    model = _model(family, implementation, dtype)
    out = torch.zeros(ids.shape + (VOCAB if family != "bert" else 64,), dtype=torch.float64)
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        out[b, keep] = _output(model, ids[b:b + 1, keep], mask[b:b + 1, keep])[0]
    return out


def test_register_makes_the_name_known():
    assert "mha" in transformers.AttentionInterface._global_mapping
    assert "mha" in transformers.masking_utils.AttentionMaskInterface._global_mapping
    assert mt.register("mha-test") == "mha-test"
    assert transformers.AttentionInterface._global_mapping["mha-test"] is mt.attention_forward
    for bad in ("", None, 3):
        with pytest.raises(mha.Error, match="name"):  # an mha.Error is a ValueError too
            mt.register(bad)


def test_models_call_mhas_attention(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return mt.attention_forward(*args, **kwargs)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "mha", counting)
    ids, mask = _inputs()
    _output(_model("llama", "mha"), ids, mask)
    assert calls == [(2, 4, 40, 16)] * 2  # both layers, GQA query heads


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_eager_float64(family):
    ids, mask = _inputs(left=family not in _RIGHT_PADDED)
    ref = _reference(family, ids, mask)
    base = _output(_model(family, _BASELINE.get(family, "sdpa")), ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback may happen
        got = _output(_model(family, "mha"), ids, mask)
    err_base = (base - ref).abs().max().item()
    err_mha = (got - ref).abs().max().item()
    assert err_mha <= 2 * err_base + 1e-6, (family, err_mha, err_base)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "gemma2"])
def test_padded_batch_equals_each_sequence_alone(family):
    ids, mask = _inputs(pad=(0, 9), left=family not in _RIGHT_PADDED)
    model = _model(family, "mha")
    batched = _output(model, ids, mask)
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        alone = _output(model, ids[b:b + 1, keep], mask[b:b + 1, keep])
        torch.testing.assert_close(batched[b, keep], alone[0], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss", "qwen3"])
def test_cached_decoding_and_chunked_prefill_match_a_full_forward(family):
    """Prefill 20 tokens into transformers' cache, then a chunk of 7 (bottom-right: the chunk's
    queries see the cached keys), then single tokens: logits as one forward over everything."""
    ids, mask = _inputs(batch=2, length=30, pad=(0, 5))
    model = _model(family, "mha")
    full = _output(model, ids, mask)
    with torch.no_grad():
        out = model(input_ids=ids[:, :20], attention_mask=mask[:, :20], use_cache=True)
        cache = out.cache
        pieces = [out.logits]
        out = model(input_ids=ids[:, 20:27], attention_mask=mask[:, :27], cache=cache, use_cache=True)
        pieces.append(out.logits)
        for t in range(27, 30):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache,
                        use_cache=True)
            pieces.append(out.logits)
    got = torch.cat(pieces, dim=1).double().masked_fill(mask[..., None] == 0, 0.0)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


def test_generate_gives_sdpas_greedy_tokens_with_left_padding():
    ids, mask = _inputs(batch=3, length=12, pad=(0, 4, 7))
    tokens = {}
    for impl in ("sdpa", "mha"):
        model = _model("llama", impl)
        model.generation_config.pad_token_id = 0
        with torch.no_grad():
            tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64,
                                          do_sample=False)
    assert tokens["mha"].shape == (3, 12 + 64)
    assert torch.equal(tokens["mha"], tokens["sdpa"])


def test_training_loss_curve_matches_sdpa():
    ids, mask = _inputs(batch=4, length=32, pad=(0, 3, 0, 6))
    curves = {}
    for impl in ("sdpa", "mha"):
        model = _model("llama", impl).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(30):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[impl] = torch.tensor(losses)
    assert curves["mha"][-1] < curves["mha"][0] - 0.5  # it learns
    torch.testing.assert_close(curves["mha"], curves["sdpa"], rtol=1e-3, atol=0)


def test_sinks_are_trained():
    ids, mask = _inputs()
    model = _model("gpt_oss", "mha").train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    grads = [layer.self_attn.sinks.grad for layer in model.model.layers]
    ref = _model("gpt_oss", "eager").train()
    ref(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    for g, layer in zip(grads, ref.model.layers):
        assert g is not None and g.abs().max() > 0
        torch.testing.assert_close(g, layer.self_attn.sinks.grad, rtol=1e-3, atol=1e-6)


def test_attention_weights_when_asked_for():
    ids, mask = _inputs()
    outs = {}
    for impl in ("eager", "mha"):
        with torch.no_grad():
            outs[impl] = _model("llama", impl)(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(outs["mha"]) == 2
    for a, b in zip(outs["mha"], outs["eager"]):
        assert a.shape == b.shape == (2, 4, 40, 40)
        rows = mask.bool()[:, None, :, None].expand_as(a)  # padding queries: mha gives zeros
        torch.testing.assert_close(a[rows], b[rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_within_twice_sdpas_error(dtype):
    ids, mask = _inputs()
    ref = _reference("llama", ids, mask)
    err = {impl: (_output(_model("llama", impl, dtype), ids, mask) - ref).abs().max().item()
           for impl in ("sdpa", "mha")}
    assert err["mha"] <= 2 * err["sdpa"] + 1e-3, err


def test_attention_dropout_in_training_only():
    cls, config = _config("bert")
    config.attention_probs_dropout_prob = 0.5
    torch.manual_seed(0)
    model = cls(config)
    model.set_attn_implementation("mha")
    ids, mask = _inputs(left=False)
    model.eval()
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask).last_hidden_state, model(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(a, b)
    model.train()
    c = model(ids, attention_mask=mask).last_hidden_state
    d = model(ids, attention_mask=mask).last_hidden_state
    assert not torch.equal(c, d) and not torch.allclose(c, a, atol=1e-3)
    c.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_float64_falls_back_with_one_warning():
    ids, mask = _inputs()
    ref = _output(_model("llama", "sdpa", torch.float64), ids, mask)
    model = _model("llama", "mha", torch.float64)
    mt._warned.clear()
    with pytest.warns(UserWarning, match="float64") as record:
        got = _output(model, ids, mask)
        _output(model, ids, mask)
    assert sum("float64" in str(w.message) for w in record) == 1
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_softcap_fallback_keeps_the_mask():
    """A float64 Gemma 2 falls back to its eager formula, which needs an additive mask: the
    boolean one of "mha" is converted, causal included (unpadded: with padding, the eager formula
    itself turns float64 batches into NaN)."""
    ids, mask = _inputs(pad=(0, 0))
    ref = _reference("gemma2", ids, mask)
    mt._warned.clear()
    with pytest.warns(UserWarning, match="float64"):
        got = _output(_model("gemma2", "mha", torch.float64), ids, mask)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_fallback_without_an_eager_formula_is_an_error():
    """softcap or sinks that mha cannot run (float64 here) need the model's eager formula: a
    module defined where there is none gets an error, not sdpa silently without them."""
    class Attention(torch.nn.Module):
        is_causal = True

    q = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    mt._warned.clear()
    with pytest.warns(UserWarning, match="float64"), pytest.raises(mha.Error, match="no eager_attention_forward"):
        mt.attention_forward(Attention(), q, q, q, None, softcap=5.0)


@pytest.mark.parametrize("mask_kind", ["causal", "none", "bool", "float"])
def test_position_bias_is_added_to_the_scores(mask_kind):
    """T5's relative position bias runs on mha's kernels (no fallback warning), as transformers'
    sdpa runs it (create_position_bias_mask): added to the scores; with no mask and is_causal,
    the future masked top-left; a boolean mask's False positions out; a float mask added. GQA
    heads (4 query heads over 2 key heads), Tq < Tk; every row keeps a key; the bias strided as
    T5's (a permuted embedding). Against sdpa in float64: float32 rounding."""
    class Attention(torch.nn.Module):
        is_causal = mask_kind == "causal"
        num_key_value_groups = 2

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, t, 8, generator=g) for h, t in ((4, 5), (2, 7), (2, 7)))
    bias = torch.randn(5, 7, 4, generator=g).permute(2, 0, 1)[None]  # T5's layout: keys 4 apart
    mask = None
    if mask_kind == "bool":
        mask = (torch.rand(2, 1, 5, 7, generator=g) < 0.6) | torch.eye(5, 7, dtype=torch.bool)
    elif mask_kind == "float":
        mask = torch.randn(2, 1, 5, 7, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        got, _ = mt.attention_forward(Attention(), q, k, v, mask, position_bias=bias)
    ref, _ = sdpa_attention_forward(Attention(), q.double(), k.double(), v.double(),
                                    mask.double() if mask_kind == "float" else mask, position_bias=bias.double())
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(mha.Error, match="position_bias must be float32"):
        mt.attention_forward(Attention(), q, k, v, mask, position_bias=bias.double())
    for bad in (torch.tensor(1.0), bias[None]):
        with pytest.raises(mha.Error, match=r"position_bias must be \(\.\.\., Tq, Tk\)"):
            mt.attention_forward(Attention(), q, k, v, mask, position_bias=bad)
    # A bias (or a mask beside one) that does not broadcast to (B, Hq, Tq, Tk) = (2, 4, 5, 7):
    # named, before torch.where or + combines them (torch's RuntimeError) or sdpa names attn_bias.
    for bad in (bias[:, :2], bias[..., :5], torch.zeros(3, 4, 5, 7)):
        with pytest.raises(mha.Error, match=r"position_bias \(.*\) does not broadcast to the scores"):
            mt.attention_forward(Attention(), q, k, v, mask, position_bias=bad)
    if mask is not None:
        with pytest.raises(mha.Error, match=r"attention_mask \(2, 1, 5, 5\) does not broadcast"):
            mt.attention_forward(Attention(), q, k, v, mask[..., :5], position_bias=bias)


def _t5(implementation, dtype=torch.float32):
    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, dropout_rate=0.0,
                      pad_token_id=0, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = T5Model(config).eval()
    model.set_attn_implementation(implementation)
    return model.to(dtype)


def test_t5_runs_on_mha_against_eager_float64():
    """T5: a relative position bias in every self-attention's scores (the encoder's, bidirectional
    with right padding; the decoder's, causal), cross-attention without one. Under no_grad mha
    runs every call (no fallback warning), within 2x sdpa's float32 error against eager float64."""
    ids, mask = _inputs(pad=(0, 7), left=False)
    dec = _inputs(length=12, pad=(0, 0), seed=2)[0]

    def run(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state.double()

    ref = run(_t5("eager", torch.float64))
    base = run(_t5("sdpa"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(_t5("mha"))
    err_base = (base - ref).abs().max().item()
    err_mha = (got - ref).abs().max().item()
    assert err_mha <= 2 * err_base + 1e-6, (err_mha, err_base)


def test_t5_training_runs_on_mha_with_the_position_bias_gradient():
    """In training the position bias is learned: mha's backward gives its gradient (the
    attn_mask's, summed over the batch it broadcasts along), so no call falls back, and the
    gradients of the relative-attention-bias embedding and of a projection equal sdpa's."""
    ids, mask = _inputs(pad=(0, 7), left=False)
    dec = _inputs(length=12, pad=(0, 0), seed=2)[0]
    grads = {}
    mt._warned.clear()
    for implementation in ("sdpa", "mha"):
        model = _t5(implementation).train()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state.square().sum().backward()
        encoder, decoder = (m.block[0].layer[0].SelfAttention for m in (model.encoder, model.decoder))
        grads[implementation] = [encoder.relative_attention_bias.weight.grad,
                                 decoder.relative_attention_bias.weight.grad, encoder.q.weight.grad]
        if implementation == "mha":
            assert not [str(w.message) for w in record if "mha" in str(w.message)]
    for got, want in zip(grads["mha"], grads["sdpa"]):
        assert got.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
