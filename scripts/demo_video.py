"""The demo's video rollouts (``scripts/demo.py --video``, issue 44 part 4): what differs from the
image demo is the prompts and the server's media limit; the RL step is the same code.

- :func:`video_messages`: two prompts, each one short real clip (``video_clips.clip_bytes``: a
  scikit-image photo panned into an MP4 with OpenCV, the decoder the server and the trainer use)
  and a question; rollout code holds the clip's bytes and ``rollout_client`` offloads each clip
  once (``protocol.adapters.offload_video``) and expands its ``<|video_pad|>`` as vLLM's chat
  route would.
- :data:`VIDEO_ON`: the server's ``--limit-mm-per-prompt`` with video on (``start_server`` turns
  video off; the last flag wins).
- :func:`check_family`: the families whose video refs the token route takes (one placeholder run
  per video: Qwen2.5-VL); Qwen3-VL's per-frame runs are the chat route's only.
"""

from __future__ import annotations

from video_clips import clip_bytes

__all__ = ["CLIPS", "VIDEO_ON", "check_family", "media_url_part", "video_messages"]

CLIPS = (("astronaut", "What happens in the video?"), ("coffee", "Describe the video."))
"""(photo panned into the clip, question): one RL prompt each."""

VIDEO_ON = ("--limit-mm-per-prompt", '{"image": 1, "video": 1}')


def video_messages() -> list[list[dict]]:
    """One user message per :data:`CLIPS` entry: the clip's MP4 bytes, then the question."""
    return [
        [
            {
                "role": "user",
                "content": [{"type": "video", "video": clip_bytes(photo)}, {"type": "text", "text": text}],
            }
        ]
        for photo, text in CLIPS
    ]


def check_family(family: str) -> None:
    """Refuse a family whose video refs the token route cannot take.

    Raises:
        SystemExit: not Qwen2.5-VL (the one family with a video path and one run per video).
    """
    from protocol.adapters import VIDEO_FAMILIES

    spec = VIDEO_FAMILIES.get(family)
    if spec is None or spec.per_frame_runs:
        raise SystemExit(
            f"--video runs rollouts through the token route, which takes video refs for qwen2_5_vl; "
            f"{family} is not supported there (Qwen3-VL, Qwen3.5: the chat route's video_url only)"
        )


def media_url_part(ref, url: str) -> dict:
    """The chat route's content part for ``ref``'s bytes as ``url`` (``image_url`` or ``video_url``)."""
    kind = "video_url" if ref.modality == "video" else "image_url"
    return {"type": kind, kind: {"url": url}}
