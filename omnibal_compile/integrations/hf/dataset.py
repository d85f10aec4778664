"""A conversation dataset through a Hugging Face model's own processor: real tokens, real pixels, assistant labels.

Records are LLaVA / ShareGPT style (``conversations`` of ``from``/``value``) or ``messages`` of
``role``/``content``, with ``image`` (one path or a list; relative to the image root) or none
(text-only), in a ``.json`` list or a ``.jsonl`` file.

Glossary:
    rendering     the conversation rendered by the chat template (the processor's, else its
                  tokenizer's) as text; the dataset's ``<image>`` marks become the family's image mark
                  (the processor's image token; Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``,
                  whose ``<|image_pad|>`` the processor expands to t*h*w / merge^2; InternVL's
                  ``<IMG_CONTEXT>``, expanded to ``<img>``, its tiles' tokens and ``</img>``), and a record whose
                  text has fewer marks than images gets the rest at the start of its first user turn
                  (LLaVA's convention).
    assistant     each assistant turn's span of the rendering: from the end of the conversation up to
    spans         that turn rendered with the generation prompt, to the end of it rendered through the
                  turn. A template whose renderings are not prefixes of one another is refused.
    tokens        each span and each text between spans is processed on its own (``add_special_tokens``
                  off, as ``apply_chat_template(tokenize=True)`` does; images go with the text holding
                  their marks, which the processor expands to the family's image tokens), and the
                  pieces concatenated: a label boundary never falls inside a token.
    labels        the token ids on assistant spans; ``-100`` on system and user turns, template text,
                  and image tokens.
    lengths       per sample: images (tiles, one ``pixel_values`` row each: InternVL's dynamic tiles and
                  thumbnail; Qwen2-VL: merged patches, one placeholder each) and tokens, as the balancer
                  counts them (the model's own units: no tokens-per-tile conversion).
    processor     the folder's ``AutoProcessor``; for Qwen2-VL and InternVL, whose full processors need
                  torchvision (for videos, which datasets here do not have), the folder's image processor
                  and tokenizer (:class:`ImageTokenProcessor`, :class:`TileTokenProcessor`), the same in
                  every environment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnibal_compile._utils.labels import IGNORE_INDEX
from omnibal_compile._utils.validate import open_regular_file
from omnibal_compile.data.dataset_lengths import load_local_pretrained, read_records
from omnibal_compile.data.lengths import LengthStats
from omnibal_compile.errors import InputError
from omnibal_compile.integrations.hf.inputs import GRID_FAMILIES
from omnibal_compile.progress import track

__all__ = ["ConversationDataset", "ImageTokenProcessor", "TileTokenProcessor", "TILE_TOKEN_FAMILIES", "load_processor"]

DATASET_IMAGE_MARK = "<image>"
"""How a LLaVA record marks an image in its text."""
TILE_TOKEN_FAMILIES: tuple[str, ...] = ("internvl",)
"""Model types read by :class:`TileTokenProcessor`: InternVL's Hugging Face port (the remote-code ``internvl_chat`` of
``data_plan.INTERNVL_MODEL_TYPES`` has no InternVLProcessor and names no image tokens in its tokenizer)."""
_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def load_processor(path: str | os.PathLike[str]) -> Any:
    """The processor saved in a local folder (``AutoProcessor``), without downloading anything. For a grid family
    (Qwen2-VL) or InternVL (the folder's ``config.json`` says which), whose full processors need torchvision for
    their video parts, its image processor and tokenizer (:class:`ImageTokenProcessor`,
    :class:`TileTokenProcessor`), the same in every environment."""
    folder = Path(path)
    config = folder / "config.json"
    kind = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if kind not in GRID_FAMILIES and kind not in TILE_TOKEN_FAMILIES:
        return load_local_pretrained(path, "processor", "AutoProcessor")
    images = load_local_pretrained(path, "image processor", "AutoImageProcessor")
    tokenizer = load_local_pretrained(path, "tokenizer", "AutoTokenizer")
    if kind in GRID_FAMILIES:
        return ImageTokenProcessor(image_processor=images, tokenizer=tokenizer)
    return TileTokenProcessor.from_folder(folder, image_processor=images, tokenizer=tokenizer)


class _ImageTextProcessor:
    """What the image-and-text processors below share: the tokenizer's chat template, and the text's image tokens
    replaced, one per image in order, by each image's expansion."""

    image_token: str
    tokenizer: Any

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def _expand(self, text: str, expansions: Sequence[str]) -> str:
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(expansions):
            raise ValueError(f"the text holds {len(pieces) - 1} image tokens for {len(expansions)} images")
        return pieces[0] + "".join(e + p for e, p in zip(expansions, pieces[1:]))


class ImageTokenProcessor(_ImageTextProcessor):
    """A grid family's processor for images and text, from its image processor and tokenizer (what
    ``Qwen2VLProcessor`` does for images, without its video processor): each image token of the text becomes
    ``t*h*w / merge^2`` of them for the next image's grid; returns ``input_ids``, ``pixel_values``,
    ``image_grid_thw`` and ``mm_token_type_ids`` (1 on image tokens)."""

    image_token = "<|image_pad|>"
    image_mark = "<|vision_start|><|image_pad|><|vision_end|>"
    """What the dataset's ``<image>`` becomes, as Qwen2-VL's chat template writes an image."""

    def __init__(self, *, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.merge = int(image_processor.merge_size)

    def __call__(self, *, text: str, images: Sequence[Any] = (), **kwargs: Any) -> dict[str, torch.Tensor]:
        kwargs.pop("return_tensors", None)
        out: dict[str, torch.Tensor] = {}
        if images:
            pix = self.image_processor(images=list(images), return_tensors="pt")
            out = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
            counts = (out["image_grid_thw"].prod(-1) // self.merge ** 2).tolist()
            text = self._expand(text, [self.image_token * int(n) for n in counts])
        ids = torch.as_tensor(self.tokenizer(text, return_tensors="pt", **kwargs)["input_ids"])
        token = self.tokenizer.convert_tokens_to_ids(self.image_token)
        return {"input_ids": ids, **out, "mm_token_type_ids": (ids == token).int()}


class TileTokenProcessor(_ImageTextProcessor):
    """InternVL's processor for images and text, from its image processor and tokenizer: what
    ``InternVLProcessor.__call__`` does for images, without its video processor.

    Each image is cut into tiles by the image processor's dynamic tiling (``crop_to_patches``, which
    InternVLProcessor always asks for: a grid of ``min_patches..max_patches`` tiles of the processor's ``size``
    closest to the image's aspect ratio, plus a thumbnail when the grid has more than one tile), one
    ``pixel_values`` row per tile; each ``<IMG_CONTEXT>`` of the text (the next image's mark) becomes
    ``<img>`` + ``<IMG_CONTEXT>`` x ``image_seq_length`` x its tiles + ``</img>``. Every image gets up to
    ``max_patches`` tiles, however many a record has (InternVLProcessor does not share them out as
    InternVL's own training code does). Returns ``input_ids`` and ``pixel_values`` (tiles, C, H, W)."""

    def __init__(self, *, image_processor: Any, tokenizer: Any, image_seq_length: int) -> None:
        names = ("start_image_token", "end_image_token", "context_image_token")
        missing = [n for n in names if not isinstance(getattr(tokenizer, n, None), str)]
        if missing:
            raise InputError(f"the tokenizer names no {', '.join(missing)}: InternVL's processor reads its image "
                             "tokens from them; save the tokenizer with them (extra_special_tokens={"
                             "\"start_image_token\": \"<img>\", \"end_image_token\": \"</img>\", "
                             "\"context_image_token\": \"<IMG_CONTEXT>\"}, which tokenizer_config.json keeps)")
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.image_seq_length = int(image_seq_length)
        self.start_image_token, self.end_image_token = tokenizer.start_image_token, tokenizer.end_image_token
        self.image_token: str = tokenizer.context_image_token
        self.image_mark = self.image_token
        """What the dataset's ``<image>`` becomes, as InternVL's chat template writes an image."""

    @classmethod
    def from_folder(cls, folder: Path, *, image_processor: Any, tokenizer: Any) -> TileTokenProcessor:
        """With the folder's ``image_seq_length``: its ``processor_config.json``'s (what InternVLProcessor loads),
        else its ``config.json``'s."""
        length = None
        for name in ("processor_config.json", "config.json"):
            if length is None and (folder / name).is_file():
                length = json.loads((folder / name).read_text()).get("image_seq_length")
        if not isinstance(length, int) or length < 1:
            raise InputError(f"processor folder {folder}: neither processor_config.json nor config.json gives "
                             f"InternVL's image_seq_length (image tokens per tile) as a positive int, got {length!r}")
        return cls(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=length)

    def __call__(self, *, text: str, images: Sequence[Any] = (), **kwargs: Any) -> dict[str, torch.Tensor]:
        kwargs.pop("return_tensors", None)
        out: dict[str, torch.Tensor] = {}
        if images:
            pix = self.image_processor(images=list(images), crop_to_patches=True, return_tensors="pt")
            out = {"pixel_values": pix["pixel_values"]}
            text = self._expand(text, [
                self.start_image_token + self.image_token * (self.image_seq_length * int(n)) + self.end_image_token
                for n in pix["num_patches"]])
        ids = torch.as_tensor(self.tokenizer(text, return_tensors="pt", **kwargs)["input_ids"])
        return {"input_ids": ids, **out}


class ConversationDataset(torch.utils.data.Dataset):
    """Samples ``{"input_ids", "labels", "pixel_values"}`` (1-D ids and labels; pixels [images, C, H, W], or for a
    grid family the processor's patches [patches, C*T*P*P] with ``image_grid_thw`` [images, 3]).

    ``processor``: a Hugging Face processor (a tokenizer alone for text-only data). ``image_root``: the
    folder image paths are relative to (default: the dataset file's folder). A record that cannot be
    read (a missing or unreadable image, no assistant turn) raises :class:`InputError` naming it; with
    ``skip_bad``, :meth:`lengths` leaves such records out (``skipped``: record index and reason) and the
    samples are the kept records (``kept[i]``: the record index of sample ``i``).
    """

    def __init__(self, path: str | os.PathLike[str], processor: Any, *, image_root: str | None = None,
                 skip_bad: bool = False) -> None:
        self.path = Path(path)
        self.records = read_records(self.path)
        self.skip_bad = skip_bad
        self.kept: list[int] = list(range(len(self.records)))
        self.skipped: list[tuple[int, str]] = []
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.image_root = Path(image_root) if image_root is not None else self.path.parent
        self.image_token = getattr(processor, "image_token", None)
        self.image_mark: str = getattr(processor, "image_mark", None) or self.image_token or ""
        holder = processor if getattr(processor, "chat_template", None) else self.tokenizer
        if not getattr(holder, "chat_template", None):
            raise InputError(f"{self.path}: the processor and its tokenizer have no chat template; save one with the "
                             "tokenizer (tokenizer.chat_template = ...) to render conversations")
        self._template = holder

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self._sample(self.kept[index])

    def _sample(self, record: int) -> dict[str, torch.Tensor]:
        where, rec = self.records[record]
        messages, images = self._parse(where, rec)
        pieces = self._pieces(where, messages)
        ids: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        used = 0
        for text, trained in pieces:
            marks = text.count(self.image_token) if self.image_token else 0
            if marks and trained:
                raise InputError(f"{where}: an assistant turn holds an image mark; images belong to user turns")
            mine = images[used:used + marks]
            used += marks
            out = self._process(where, text, [self._open(where, p) for p in mine])
            piece = torch.as_tensor(out["input_ids"]).reshape(-1).long()
            ids.append(piece)
            labels.append(piece.clone() if trained else torch.full_like(piece, IGNORE_INDEX))
            if mine:
                pixels.append(torch.as_tensor(out["pixel_values"]).float())
                if "image_grid_thw" in out:
                    grids.append(torch.as_tensor(out["image_grid_thw"]).long())
        sample = {"input_ids": torch.cat(ids), "labels": torch.cat(labels)}
        if self.image_token is not None:
            token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
            sample["labels"][sample["input_ids"] == token_id] = IGNORE_INDEX
        if pixels:
            sample["pixel_values"] = torch.cat(pixels)
        if grids:
            sample["image_grid_thw"] = torch.cat(grids)
        return sample

    def lengths(self, *, progress: bool = True) -> LengthStats:
        """Images and tokens of every sample as processed (see the module glossary), in dataset order; with
        ``skip_bad``, of the records that can be read (the others are listed in ``skipped``)."""
        tiles, tokens, kept, skipped = [], [], [], []
        for r in track(range(len(self.records)), f"measuring the samples of {self.path.name}", enabled=progress):
            try:
                s = self._sample(r)
            except InputError as e:
                if not self.skip_bad:
                    raise
                skipped.append((r, str(e)))
                continue
            kept.append(r)
            tokens.append(s["input_ids"].numel())
            if "image_grid_thw" in s:  # a grid family's tiles: its merged patches (module glossary: lengths)
                tiles.append(int(s["image_grid_thw"].prod(-1).sum()) // int(self.processor.image_processor.merge_size)
                             ** 2)
            else:
                tiles.append(s["pixel_values"].shape[0] if "pixel_values" in s else 0)
        if not kept:
            raise InputError(f"{self.path}: none of its {len(self.records)} records can be read; the first: "
                             f"{skipped[0][1]}")
        self.kept, self.skipped = kept, skipped
        t = np.asarray(tiles, np.int64)
        return LengthStats(tiles=t, tokens=np.asarray(tokens, np.int64), image_flags=t.copy(), source=str(self.path))

    # -- the parts ------------------------------------------------------------------------------------
    def _parse(self, where: str, rec: Any) -> tuple[list[dict[str, str]], list[str]]:
        if not isinstance(rec, dict):
            raise InputError(f"{where}: expected an object with 'conversations' or 'messages', got "
                             f"{type(rec).__name__}")
        turns = rec.get("conversations", rec.get("messages"))
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{where}: needs a non-empty 'conversations' (from/value) or 'messages' (role/content)")
        messages = []
        for k, t in enumerate(turns):
            role = t.get("from", t.get("role")) if isinstance(t, dict) else None
            value = t.get("value", t.get("content")) if isinstance(t, dict) else None
            if not isinstance(role, str) or not isinstance(value, str) or _ROLES.get(role) is None:
                raise InputError(f"{where}: turn {k} needs a role (human/gpt/user/assistant/system) and a string text")
            messages.append({"role": _ROLES[role], "content": value})
        if not any(m["role"] == "assistant" for m in messages):
            raise InputError(f"{where}: has no assistant turn, so nothing to train on")
        img = rec.get("image", rec.get("images"))
        images = [] if img in (None, "", []) else [img] if isinstance(img, str) else img
        if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
            raise InputError(f"{where}: 'image' must be a path or a list of paths, got {img!r}")
        if images and self.image_token is None:
            raise InputError(f"{where}: has images, but the processor has no image token (a text-only tokenizer?)")
        if self.image_token is not None:
            for m in messages:
                m["content"] = m["content"].replace(DATASET_IMAGE_MARK, self.image_mark)
            marks = sum(m["content"].count(self.image_token) for m in messages)
            if marks > len(images):
                raise InputError(f"{where}: its text marks {marks} images but it has {len(images)}")
            first = next((m for m in messages if m["role"] == "user"), None)
            if marks < len(images):
                if first is None:
                    raise InputError(f"{where}: has images but no user turn to put them in")
                first["content"] = self.image_mark * (len(images) - marks) + "\n" + first["content"]
        return messages, images

    def _render(self, messages: Sequence[dict[str, str]], prompt: bool = False) -> str:
        return str(self._template.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=prompt))

    def _pieces(self, where: str, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        """The rendering cut into (text, is an assistant span) pieces (module glossary)."""
        full = self._render(messages)
        pieces: list[tuple[str, bool]] = []
        done = 0
        for t, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start, end = len(self._render(messages[:t], prompt=True)), len(self._render(messages[: t + 1]))
            if not (done <= start <= end <= len(full)) or not full.startswith(self._render(messages[: t + 1])):
                raise InputError(f"{where}: the chat template's renderings are not prefixes of one another, so the "
                                 "assistant turns cannot be found; use a template that renders turn by turn")
            pieces += [(full[done:start], False), (full[start:end], True)]
            done = end
        pieces.append((full[done:], False))
        return [(text, trained) for text, trained in pieces if text]

    def _process(self, where: str, text: str, images: list[Any]) -> Any:
        try:
            if images:
                return self.processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
            return self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        except Exception as e:  # the processor's own errors (image/token count mismatch, a bad image)
            raise InputError(f"{where}: the processor refused it ({type(e).__name__}: {e})") from None

    def _open(self, where: str, path: str) -> Any:
        from PIL import Image

        full = self.image_root / path
        try:
            with open_regular_file(full) as f, Image.open(f) as im:
                return im.convert("RGB")
        except (OSError, InputError) as e:
            raise InputError(f"{where}: image {full} cannot be read ({e})") from None
