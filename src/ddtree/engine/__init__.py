"""The engine: continuous batching of AR, DFlash-chain and DDTree requests over one loaded target and drafter."""
