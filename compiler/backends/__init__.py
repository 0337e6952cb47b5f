"""Per-backend lowering and engine builds (stage 5 of `trtc build`).

* ``tensorrt-rtx``: `rtx_lowering.lower_for_rtx` rewrites the paged graph to the slot contract
  (`slot_contract.py`, a contiguous KV cache per slot, native layers only) and
  `tensorrt_rtx.build_rtx_engines` builds one engine per target architecture, CPU-only.
"""
