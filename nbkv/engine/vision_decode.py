"""Decoding an image's embeddings into a slot, between the other requests' steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbkv.core.errors import MediaError

if TYPE_CHECKING:
    from nbkv.engine.jobs import Job
    from nbkv.engine.scheduler import Scheduler


def decode_image(sched: Scheduler, job: Job) -> bool:
    """Decode the image at the head of ``job``'s prefill, if its embeddings are ready.

    Where a picture starts, the projector's embedding service is asked once: held by the
    request or cached (a hit), else it encodes on its own thread (a run; the other requests
    keep decoding meanwhile); it counts either in ``job``. False while the encoder is still
    at work.
    """
    projector, ctx = sched.res.projector, sched.res.ctx
    unit = job.todo[0]
    chunk = job.prompt.chunk_for(unit)
    n = chunk.n_pos
    if n >= len(job.todo):
        sched.fail(job, MediaError("a prompt must not end with an image"), "error")
        return True
    image = chunk.image
    assert image is not None  # chunk_for gives image chunks only
    h = image.hash
    fut = job.take_encoding()  # done: the step skips the job until then
    try:
        if fut is None and (h not in job.embeddings
                            or (chunk.sub_index == 0 and not job.image_piece)):
            fut = projector.embeddings.fetch(image, job.prompt.media,
                                             held=job.embeddings, tally=job, wait=False)
            if not fut.done():
                job.wait_encoder(fut)
                fut.add_done_callback(lambda _: sched.wake())
                return False
        if fut is not None:
            job.embeddings[h] = fut.result()
    except BaseException as e:  # noqa: BLE001
        sched.fail(job, e, "error")
        return True
    emb = job.embeddings[h]
    slot = job.placed_slot
    # a big causal image goes in sub-batches, one per step, between the other
    # requests' tokens (a non-causal one is a single batch)
    total = projector.pieces(ctx, chunk)
    piece = job.image_piece
    try:
        projector.decode_chunk(ctx, chunk, slot.seq_id, len(slot.kv),
                               embedding=emb, piece=piece if total > 1 else None)
    except BaseException as e:  # noqa: BLE001 - decode_chunk removed what it decoded
        job.drop_pieces()
        sched.fail(job, e, "error")
        return True
    if piece + 1 < total:
        job.piece_read()
        return True
    slot.kv.extend(job.todo[:n], settled=len(slot.kv) + n)
    job.read(n)
    slot.kv.checkpoint()  # a follow-up question never re-decodes the image
    sched.progress(job)
    return True
