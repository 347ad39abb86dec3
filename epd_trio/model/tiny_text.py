"""The text side of a tiny checkpoint: a tokenizer and a chat template.

A language server (vLLM) loads a checkpoint's tokenizer and renders chat
requests with its template before any weight is used, so a tiny checkpoint
that is to be *served* needs both. They are generated here, never
downloaded: a byte-level tokenizer with no merges (every byte is a token, so
any text encodes and any generated id decodes) whose first ids are the
special tokens the tiny configs name (``tiny.py``: bos 0, eos 1, pad 2,
image 3, video 4, vision start 5 and end 6, audio 7), padded with reserved
tokens to exactly the model's vocabulary size.

The template follows the Qwen families' layout: ``<|im_start|>role\\n … <|im_end|>``
turns, an image as ``<|vision_start|><|image_pad|><|vision_end|>``, a video
with ``<|video_pad|>``, an audio clip as ``<|audio_bos|><|AUDIO|><|audio_eos|>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from epd_trio.model.tiny import TinySpec

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "save_text_side"]

# In id order: the ids are the ones tiny.py's configs name.
SPECIAL_TOKENS: Final = (
    "<|endoftext|>", "<|im_end|>", "<|pad|>", "<|image_pad|>", "<|video_pad|>",
    "<|vision_start|>", "<|vision_end|>", "<|AUDIO|>", "<|im_start|>", "<|audio_bos|>",
    "<|audio_eos|>",
)

CHAT_TEMPLATE: Final = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' or part['type'] == 'audio_url' or part['type'] == 'input_audio' %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    reserved = vocab_size - len(SPECIAL_TOKENS) - len(alphabet)
    if reserved < 0:
        raise ValueError(f"a tiny tokenizer needs vocab_size >= {len(SPECIAL_TOKENS) + len(alphabet)}, "
                         f"got {vocab_size}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update((char, len(SPECIAL_TOKENS) + i) for i, char in enumerate(alphabet))
    extra = [f"<|reserved_{k}|>" for k in range(reserved)]
    vocab.update((token, len(vocab)) for token in extra)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([*SPECIAL_TOKENS, *extra])  # already in the vocabulary: ids kept
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|pad|>")


def _processor(arch: str, tokenizer: Any, processors: list[Any]) -> Any:
    """The family's combined processor, as a user's download carries it."""
    import transformers

    if arch == "qwen2_audio":
        return transformers.Qwen2AudioProcessor(feature_extractor=processors[0], tokenizer=tokenizer,
                                                chat_template=CHAT_TEMPLATE)
    kind = {"qwen2_vl": transformers.Qwen2VLProcessor, "qwen2_5_vl": transformers.Qwen2_5_VLProcessor,
            "qwen3_vl": transformers.Qwen3VLProcessor}[arch]
    image, video = processors
    return kind(image_processor=image, tokenizer=tokenizer, video_processor=video,
                chat_template=CHAT_TEMPLATE)


def save_text_side(directory: Path, spec: TinySpec, processors: list[Any]) -> None:
    """Write the tokenizer, and the family's processor with the chat template, into ``directory``."""
    tokenizer = _tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(directory)
    _processor(spec.arch, tokenizer, processors).save_pretrained(directory)
