//! Writes operation lists in the byte format `arbitrary` 1.x reads them back from, so seed
//! corpora can be built from readable operations (`examples/gen_corpus.rs` checks each one by
//! parsing it back).
//!
//! The format: integers little-endian at their width; `bool` one byte (low bit); `Option<T>` a
//! `bool` then `T`; a derived enum variant `i` of `n` is a `u32` `v` with `(v * n) >> 32 == i`,
//! then its fields in order; a top-level `Vec<T>` (read with `arbitrary_take_rest`) is each
//! element preceded by a `true` byte, ended by a `false` byte or the end of the input.

/// A value that can be written in `arbitrary`'s input format.
pub trait ToSeed {
    /// Appends the bytes `arbitrary` reads this value from.
    fn write_seed(&self, out: &mut Vec<u8>);
}

/// The input a fuzz target taking `Vec<T>` reads `ops` from.
pub fn ops<T: ToSeed>(ops: &[T]) -> Vec<u8> {
    let mut out = Vec::new();
    for op in ops {
        out.push(1);
        op.write_seed(&mut out);
    }
    out
}

/// Writes the discriminant of variant `index` of a derived enum with `count` variants.
pub fn variant(out: &mut Vec<u8>, index: u32, count: u32) {
    assert!(index < count);
    // The smallest `v` with `v * count >= index << 32`; then `(v * count) >> 32 == index`.
    let v = (u64::from(index) << 32).div_ceil(u64::from(count));
    let v = u32::try_from(v).expect("index < count");
    out.extend_from_slice(&v.to_le_bytes());
}

impl ToSeed for u8 {
    fn write_seed(&self, out: &mut Vec<u8>) {
        out.push(*self);
    }
}

impl ToSeed for u16 {
    fn write_seed(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl<T: ToSeed> ToSeed for Option<T> {
    fn write_seed(&self, out: &mut Vec<u8>) {
        match self {
            None => out.push(0),
            Some(v) => {
                out.push(1);
                v.write_seed(out);
            }
        }
    }
}
