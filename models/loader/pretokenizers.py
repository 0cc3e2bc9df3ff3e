"""llama.cpp's pre-tokenizers by `tokenizer.ggml.pre` name, rebuilt for the `tokenizers` library.

A GGUF stores no pre-tokenizer, only a name. llama.cpp (src/llama-vocab.cpp) maps it to regexes
applied in turn, each splitting every piece the previous one left (matches and the text between
them both become pieces), then spells bytes in GPT-2's byte alphabet. We rebuild that: one
`Split(regex, "isolated")` per regex, then `ByteLevel(use_regex=False)`. Writing needs the name
back: `detect_pre` runs each known pre-tokenizer and the bundle's own on a probe text and takes the
one that splits it identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, pre_tokenizers


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _TAIL
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           + r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UP, _LOW, _NOT_LN = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", r"[^\r\n\p{L}\p{N}]?"
_CASED_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = _NOT_LN + _UP + "*" + _LOW + "+|" + _NOT_LN + _UP + "+" + _LOW + r"*|\p{N}" + _CASED_TAIL
_GPT4O = (_NOT_LN + _UP + "*" + _LOW + "+" + _CONTRACTIONS + "?|" + _NOT_LN + _UP + "+" + _LOW + "*"
          + _CONTRACTIONS + r"?|\p{N}{1,3}" + _CASED_TAIL)
# Kimi-K2's tiktoken pattern (tokenization_kimi.py): Han runs alone, and gpt-4o's cased words without Han
# (its `[...&&[^\p{Han}]]` classes written as a lookahead, which the `tokenizers` regex engine has)
_NO_HAN_UP, _NO_HAN_LOW = r"(?:(?!\p{Han})" + _UP + ")", r"(?:(?!\p{Han})" + _LOW + ")"
_KIMI_K2 = (r"\p{Han}+|" + _NOT_LN + _NO_HAN_UP + "*" + _NO_HAN_LOW + "+" + _CONTRACTIONS + "?|" + _NOT_LN
            + _NO_HAN_UP + "+" + _NO_HAN_LOW + "*" + _CONTRACTIONS + r"?|\p{N}{1,3}|" + _TAIL)
_SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_YOUTU = ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
          "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
          _NOT_LN + _UP + "*" + _LOW + "+" + _CONTRACTIONS + "?|" + _NOT_LN + _UP + "+" + _LOW + "*" + _CONTRACTIONS
          + r"?|\p{N}" + _CASED_TAIL)
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _TAIL  # Qwen2's without the contractions
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r'[!"#$%&' + "'" + r"()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


@dataclass(frozen=True)
class _Pre:
    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces the previous left
    ignore_merges: bool  # a word that is itself a token is not merged (llama.cpp's `ignore_merges`)
    add_bos: bool  # llama.cpp's default for `tokenizer.ggml.add_bos_token`


# Families of `tokenizer.ggml.pre` names sharing one llama.cpp pre-tokenizer; the first name is the
# one we write. Order matters when writing: the first family that splits the probe alike wins.
_PRE_FAMILIES: list[tuple[tuple[str, ...], _Pre]] = [
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _Pre(_DEEPSEEK3, False, False)),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     _Pre((_LLAMA3,), True, True)),
    (("dbrx", "smaug-bpe", "chatglm-bpe"), _Pre((_LLAMA3,), False, False)),
    (("glm4", "glm5"), _Pre((_LLAMA3,), True, False)),  # (GLM-4.5+: Llama 3's regex, no BOS, words kept whole)
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     _Pre((r"\p{N}", _GPT2), False, False)),
    (("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"), _Pre((_GPT2,), False, False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
     _Pre((_QWEN2,), False, False)),
    (("qwen35",), _Pre((_QWEN35,), False, False)),
    (("deepseek-llm",), _Pre(_DEEPSEEK_LLM, False, False)),
    (("deepseek-coder",), _Pre(_DEEPSEEK_CODER, False, False)),
    (("default",), _Pre(_DEFAULT, False, False)),
    (("falcon",), _Pre(_FALCON, False, False)),
    (("tekken",), _Pre((_TEKKEN,), True, True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _Pre((_GPT4O,), False, False)),
    (("bloom", "poro-chat", "gpt3-finnish"), _Pre((_BLOOM,), False, False)),
    (("viking",), _Pre((_BLOOM, r"\p{N}"), False, False)),
    (("kimi-k2",), _Pre((_KIMI_K2,), False, False)),
    (("seed-coder",), _Pre((_SEED_CODER,), False, False)),
    (("youtu",), _Pre(_YOUTU, True, False)),
    (("ufakzeka",), _Pre((_UFAKZEKA,), False, False)),
]
PRE_TOKENIZERS: dict[str, _Pre] = {name: pre for names, pre in _PRE_FAMILIES for name in names}

# llama.cpp's converter's `chktxt` (the text whose token ids name a pre-tokenizer there), plus code and CJK.
_PROBE = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f (multiple "
    "emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "\u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 ?\u6211\u60f3"
    "\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= \u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a"
    "\u043b\u0433\u0430\u0440\u0441\u043a\u0438 ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
    "\ndef f(x_1, y):\r\n\treturn {'k': [x_1**2, y]}  # \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068"
    "\ud55c\uad6d\uc5b4 \u00c0\u00e9\u00ee\u00f5\u00fc \u2126\u212a caf\u00e9 \u0928\u092e\u0938\u094d\u0924\u0947 "
    "\u0645\u0631\u062d\u0628\u0627 \u00bd\u2163\u0663 $100,000.00 <tag attr=\"v\">   end  "
)


def byte_level_pre_tokenizer(regexes: Sequence[str]) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def detect_pre(tok: Tokenizer, ignore_merges: bool) -> str:
    """The `tokenizer.ggml.pre` name whose llama.cpp pre-tokenizer splits the probe as `tok` does."""
    if tok.normalizer is not None and tok.normalizer.normalize_str(_PROBE) != _PROBE:
        raise ValueError("this tokenizer normalizes text, which a GGUF byte-level tokenizer cannot express")
    if tok.pre_tokenizer is None:
        raise ValueError("a byte-level BPE tokenizer without a pre-tokenizer cannot be written to GGUF")
    want = [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(_PROBE)]
    for names, pre in _PRE_FAMILIES:
        if pre.ignore_merges == ignore_merges:
            got = [piece for piece, _ in byte_level_pre_tokenizer(pre.regexes).pre_tokenize_str(_PROBE)]
            if got == want:
                return names[0]
    raise ValueError("this tokenizer's pre-tokenizer matches none llama.cpp knows by name")
