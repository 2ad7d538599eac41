"""More public model families in tiny configs, for ``tests.helpers.zoo.ZooLM(arch=...)``: the
Hugging Face families users fine-tune, built with ``XConfig(...)`` only, never a download. Nothing here
knows about lightning_parallel.

Encoder-decoders (T5, BART) get the tokens as both encoder and decoder input; vision models (ViT, DeiT)
get the 8 tokens as a 1-channel 4x4 image and predict the first target token as a class.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["MORE", "SEQ2SEQ", "VISION", "build_more"]

VOCAB, BLOCK = 32, 8


class PerLayers:
    """A config value computed from the number of layers (the other callables take width and heads)."""

    def __init__(self, value: Callable[[int], object]) -> None:
        self.value = value


LAYERS = PerLayers(lambda layers: layers)


def _causal(cls_name: str, config_name: str, **extra) -> Callable[[int, int, int], nn.Module]:
    def make(width: int, layers: int, heads: int) -> nn.Module:
        import transformers

        def value(v: object) -> object:
            if isinstance(v, PerLayers):
                return v.value(layers)
            return v(width, heads) if callable(v) else v

        config = getattr(transformers, config_name)(**{k: value(v) for k, v in extra.items()})
        return getattr(transformers, cls_name)(config)

    return make


def _llama_like(cls: str, cfg: str, **over) -> Callable[[int, int, int], nn.Module]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        intermediate_size=lambda w, h: 3 * w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        num_key_value_heads=lambda w, h: h // 2,
        max_position_embeddings=BLOCK,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    base.update(over)
    return _causal(cls, cfg, **base)


MORE: dict[str, Callable[[int, int, int], nn.Module]] = {
    "mistral": _llama_like("MistralForCausalLM", "MistralConfig", sliding_window=None),
    "qwen2": _llama_like("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": _llama_like("Qwen3ForCausalLM", "Qwen3Config", head_dim=lambda w, h: w // h),
    "gemma": _llama_like("GemmaForCausalLM", "GemmaConfig", head_dim=lambda w, h: w // h),
    "gemma2": _llama_like(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        head_dim=lambda w, h: w // h,
        sliding_window=BLOCK,
        query_pre_attn_scalar=lambda w, h: w // h,
    ),
    "phi": _causal(
        "PhiForCausalLM",
        "PhiConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        intermediate_size=lambda w, h: 3 * w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        max_position_embeddings=BLOCK,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        partial_rotary_factor=0.5,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "phi3": _llama_like(
        "Phi3ForCausalLM",
        "Phi3Config",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        original_max_position_embeddings=BLOCK,
    ),
    "gpt_neox": _causal(
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        intermediate_size=lambda w, h: 3 * w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        max_position_embeddings=BLOCK,
        rotary_pct=0.5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "gptj": _causal(
        "GPTJForCausalLM",
        "GPTJConfig",
        vocab_size=VOCAB,
        n_embd=lambda w, h: w,
        n_inner=lambda w, h: 3 * w,
        n_layer=LAYERS,
        n_head=lambda w, h: h,
        n_positions=BLOCK,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "opt": _causal(
        "OPTForCausalLM",
        "OPTConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        ffn_dim=lambda w, h: 3 * w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        word_embed_proj_dim=lambda w, h: w,
        max_position_embeddings=BLOCK,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    ),
    "falcon": _causal(
        "FalconForCausalLM",
        "FalconConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=BLOCK,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "falcon_new": _causal(
        "FalconForCausalLM",
        "FalconConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        num_kv_heads=lambda w, h: h // 2,
        new_decoder_architecture=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=BLOCK,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "bloom": _causal(
        "BloomForCausalLM",
        "BloomConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        n_layer=LAYERS,
        n_head=lambda w, h: h,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "gpt_bigcode": _causal(
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        vocab_size=VOCAB,
        n_embd=lambda w, h: w,
        n_inner=lambda w, h: 3 * w,
        n_layer=LAYERS,
        n_head=lambda w, h: h,
        n_positions=BLOCK,
        multi_query=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "stablelm": _llama_like(
        "StableLmForCausalLM",
        "StableLmConfig",
        partial_rotary_factor=0.5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    "olmo": _llama_like("OlmoForCausalLM", "OlmoConfig"),
    "olmo2": _llama_like("Olmo2ForCausalLM", "Olmo2Config"),
    "mixtral": _llama_like(
        "MixtralForCausalLM",
        "MixtralConfig",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        experts_implementation="eager",
    ),
    "qwen2_moe": _llama_like(  # a shared expert (a plain MLP) beside the routed ones, in every layer
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=lambda w, h: 3 * w,
        shared_expert_intermediate_size=lambda w, h: 2 * w,
        sliding_window=None,
        experts_implementation="eager",
    ),
    "olmoe": _llama_like(
        "OlmoeForCausalLM",
        "OlmoeConfig",
        num_experts=4,
        num_experts_per_tok=2,
        experts_implementation="eager",
    ),
    "cohere": _llama_like("CohereForCausalLM", "CohereConfig"),
    "starcoder2": _llama_like(
        "Starcoder2ForCausalLM",
        "Starcoder2Config",
        residual_dropout=0.0,
        embedding_dropout=0.0,
        attention_dropout=0.0,
        sliding_window=None,
    ),
    "gpt_neo": _causal(
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        num_layers=LAYERS,
        attention_types=PerLayers(lambda layers: [[["global", "local"], layers // 2]]),
        num_heads=lambda w, h: h,
        intermediate_size=lambda w, h: 3 * w,
        max_position_embeddings=BLOCK,
        window_size=4,
        resid_dropout=0.0,
        embed_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "codegen": _causal(
        "CodeGenForCausalLM",
        "CodeGenConfig",
        vocab_size=VOCAB,
        n_embd=lambda w, h: w,
        n_inner=lambda w, h: 3 * w,
        n_layer=LAYERS,
        n_head=lambda w, h: h,
        n_positions=BLOCK,
        n_ctx=BLOCK,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "mpt": _causal(
        "MptForCausalLM",
        "MptConfig",
        vocab_size=VOCAB,
        d_model=lambda w, h: w,
        n_layers=LAYERS,
        n_heads=lambda w, h: h,
        expansion_ratio=3,
        max_seq_len=BLOCK,
        resid_pdrop=0.0,
        emb_pdrop=0.0,
    ),
    "roberta": _causal(
        "RobertaForMaskedLM",
        "RobertaConfig",
        vocab_size=VOCAB,
        hidden_size=lambda w, h: w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        intermediate_size=lambda w, h: 3 * w,
        max_position_embeddings=BLOCK + 2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    ),
    "distilbert": _causal(
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        vocab_size=VOCAB,
        dim=lambda w, h: w,
        n_layers=LAYERS,
        n_heads=lambda w, h: h,
        hidden_dim=lambda w, h: 3 * w,
        max_position_embeddings=BLOCK,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
    ),
    "albert": _causal(
        "AlbertForMaskedLM",
        "AlbertConfig",
        vocab_size=VOCAB,
        embedding_size=lambda w, h: w,
        hidden_size=lambda w, h: w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        intermediate_size=lambda w, h: 3 * w,
        max_position_embeddings=BLOCK,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "t5": _causal(
        "T5ForConditionalGeneration",
        "T5Config",
        vocab_size=VOCAB,
        d_model=lambda w, h: w,
        d_kv=lambda w, h: w // h,
        d_ff=lambda w, h: 3 * w,
        num_layers=LAYERS,
        num_heads=lambda w, h: h,
        dropout_rate=0.0,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    ),
    "t5_gated": _causal(
        "T5ForConditionalGeneration",
        "T5Config",
        vocab_size=VOCAB,
        d_model=lambda w, h: w,
        d_kv=lambda w, h: w // h,
        d_ff=lambda w, h: 3 * w,
        num_layers=LAYERS,
        num_heads=lambda w, h: h,
        dropout_rate=0.0,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    ),
    "bart": _causal(
        "BartForConditionalGeneration",
        "BartConfig",
        vocab_size=VOCAB,
        d_model=lambda w, h: w,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=lambda w, h: h,
        decoder_attention_heads=lambda w, h: h,
        encoder_ffn_dim=lambda w, h: 3 * w,
        decoder_ffn_dim=lambda w, h: 3 * w,
        max_position_embeddings=BLOCK,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    ),
    "vit": _causal(
        "ViTForImageClassification",
        "ViTConfig",
        hidden_size=lambda w, h: w,
        num_hidden_layers=LAYERS,
        num_attention_heads=lambda w, h: h,
        intermediate_size=lambda w, h: 3 * w,
        image_size=4,
        patch_size=2,
        num_channels=1,
        num_labels=VOCAB,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
}
SEQ2SEQ = ("t5", "t5_gated", "bart")
VISION = ("vit",)


def build_more(arch: str, width: int = 16, layers: int = 2, heads: int = 4) -> nn.Module:
    if arch not in MORE:
        raise ValueError(f"unknown architecture {arch!r}; choose from {sorted(MORE)}")
    return MORE[arch](width, layers, heads)
