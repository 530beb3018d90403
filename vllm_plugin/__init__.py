"""vLLM endpoint plugin: ``POST /inference/v1/generate`` with image refs (see ``plugin.py``)."""

__all__: list[str] = []
