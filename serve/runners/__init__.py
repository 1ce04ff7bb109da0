"""The runners: the slot-level model interface the scheduler drives (base), plain decoding (plain) and EAGLE3 / EAGLE
speculative decoding (spec)."""
