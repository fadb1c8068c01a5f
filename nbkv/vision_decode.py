"""Decoding an image's embeddings into a slot, between the other requests' steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import MediaError

if TYPE_CHECKING:
    from .jobs import Job
    from .scheduler import Scheduler


def decode_image(sched: Scheduler, job: Job) -> bool:
    """Decode the image at the head of ``job``'s prefill, if its embeddings are ready.

    Embeddings come from the cache, else the encoder runs on its own thread (the other
    requests keep decoding meanwhile). False while the encoder is still at work.
    """
    projector, ctx = sched.res.projector, sched.res.ctx
    unit = job.todo[0]
    chunk = job.prompt.chunk_for(unit)
    n = chunk.n_pos
    if n >= len(job.todo):
        sched.fail(job, MediaError("a prompt must not end with an image"), "error")
        return True
    h = chunk.image.hash
    emb = job.embeddings.get(h)
    if emb is None and job.encoding is not None:  # done: the step skips it until then
        fut, job.encoding = job.encoding, None
        try:
            emb = fut.result()
        except BaseException as e:  # noqa: BLE001
            sched.fail(job, e, "error")
            return True
    elif emb is None:
        image, media = chunk.image, job.prompt.media
        if not projector.has_cached(image):
            job.encoder_runs += 1
            job.encoding = sched.res.encoder().submit(projector.embedding, image,
                                                      _prompt=media)
            job.encoding.add_done_callback(lambda _: sched.wake())
            return False
        job.embedding_hits += 1
        try:
            emb = projector.embedding(image, _prompt=media)
        except BaseException as e:  # noqa: BLE001
            sched.fail(job, e, "error")
            return True
    elif chunk.sub_index == 0 and not job.image_piece:  # the same picture again
        job.embedding_hits += 1
    job.embeddings[h] = emb
    slot = job.slot
    # a big causal image goes in sub-batches, one per step, between the other
    # requests' tokens (a non-causal one is a single batch)
    total = projector.pieces(ctx, chunk)
    piece = job.image_piece
    try:
        projector.decode_chunk(ctx, chunk, slot.seq_id, len(slot.kv),
                               embedding=emb, piece=piece if total > 1 else None)
    except BaseException as e:  # noqa: BLE001 - decode_chunk removed what it decoded
        job.image_piece = 0
        sched.fail(job, e, "error")
        return True
    if piece + 1 < total:
        job.image_piece = piece + 1
        return True
    job.image_piece = 0
    slot.kv.extend(job.todo[:n], settled=len(slot.kv) + n)
    del job.todo[:n]
    slot.kv.checkpoint()  # a follow-up question never re-decodes the image
    sched.progress(job)
    return True
