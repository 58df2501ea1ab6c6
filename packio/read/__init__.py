"""Reading, in stages: ``positions`` (epoch order, rank / worker split, resume state) ·
``batch`` (the one batch type, ``collate``) · ``decoder`` (threads, decode, resize, error
policy) · ``datasets`` (thin map-style and iterable datasets over reader + decoder +
positions) · ``mix`` (a source like any other) · ``loader`` (``packio.DataLoader``).
Every resumable stage has ``state_dict()`` / ``load_state_dict()`` in public."""

__all__: list[str] = []
