//! Every test of `tests/dtypes.rs` again, with F16 elements read in integer arithmetic
//! (`F16Reads::Integer`) rather than through the adapter's conversion instructions, so both
//! ways of reading F16 are checked on every adapter: `tests/common`'s device takes this path
//! for this target.

#[path = "dtypes.rs"]
mod dtypes;
