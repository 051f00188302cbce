"""Training data: read a file, detect its format, apply the chat template, mask, split and pack.

Modules: `read` (files -> records with locations), `formats` (detection and normalisation to chat messages
or text, images as text/image parts), `images` (image files checked from their headers), `image_tokens` (the
image tokens of an image size, per image processor), `chat` (templates, tokenization, assistant-only loss
masks), `packing` (TRL packing and collators), `build` (the pipeline and its counts).
"""

from finetune.data.build import DataBundle, build_datasets, preview
from finetune.data.formats import detect_format

__all__ = ["DataBundle", "build_datasets", "detect_format", "preview"]
