"""The runner's encoder cache: image embeddings from the step that encodes them to the step
after which the scheduler frees them (engine.encoder_planner decides both)."""

from __future__ import annotations

import time

import torch
from torch import nn

from shortconv.engine.images import EncoderInput
from shortconv.engine.plan import StepPlan
from shortconv.execution.step_tensors import StepTensors


class EncoderCache:
    """`model.encode_images(pixels, shapes)`, on what the images' kind batches them into
    (`ImageInput.batch`, `GridImageInput.batch`), must return their tokens, concatenated."""

    def __init__(self, model: nn.Module, factor: int, device: torch.device) -> None:
        self.model, self.factor, self.device = model, factor, device
        self.entries: dict[int, torch.Tensor] = {}
        self.num_images = 0
        self.seconds = 0.0  # the encoder's time since start (metrics: encoder seconds)

    def encode(self, inputs: tuple[EncoderInput, ...]) -> None:
        """Run the encoder once over all of a step's new images (one batch)."""
        if not inputs:
            return
        start = time.perf_counter()
        images = [e.image for e in inputs]
        pixels, shapes = type(images[0]).batch(images, self.device)
        tokens = self.model.encode_images(pixels, shapes)
        if tokens.is_cuda:  # NOTE: only in steps with images: the time is the encoder's own
            torch.cuda.synchronize(tokens.device)
        self.seconds += time.perf_counter() - start
        sizes = [e.image.num_tokens(self.factor) for e in inputs]
        for e, rows in zip(inputs, torch.split(tokens, sizes), strict=True):
            self.entries[e.key] = rows
        self.num_images += len(inputs)

    def step_embeddings(self, plan: StepPlan, step: StepTensors) -> torch.Tensor:
        """The step's input embeddings: its tokens', with image rows over their placeholders."""
        self.encode(plan.encoder_inputs)
        embeds = self.model.embed_input_ids(step.input_ids)
        starts = step.query_start_loc_cpu.tolist()
        for seq, base in zip(plan.seqs, starts, strict=False):
            for s in seq.images:
                rows = self.entries[s.key][s.src : s.src + s.length]
                embeds[base + s.dst : base + s.dst + s.length] = rows.to(embeds.dtype)
        return embeds

    def free(self, keys: tuple[int, ...]) -> None:
        for key in keys:
            self.entries.pop(key, None)
