//! Element-wise reductions over the ranks' contributions, as a GPU computes them.
//!
//! Order: contributions are combined in rank order, `((x0 op x1) op x2) ...`, and every
//! intermediate is rounded to the element type, as NCCL's reduction kernels do at each hop (they
//! load, combine in the element type and store). NCCL's ring visits ranks in an order that
//! depends on the chunk, so a float sum of three or more ranks can differ from real NCCL in the
//! last place; every rank of the simulator computes the same value (NCCL guarantees that too).
//! Integers wrap, as device integer arithmetic does, and are exact. Half and bfloat16 values
//! are widened to f32 for each operation and rounded back to nearest-even. `Avg` multiplies each
//! float contribution by 1/nranks in the element type before summing (NCCL implements it as a
//! pre-multiplied sum for floats) and divides the integer sum by nranks (truncating).

use super::{DType, RedOp};

/// Combines `src` into `acc` element-wise (`acc = acc op src`), both of `dtype`.
pub fn combine(dtype: DType, op: RedOp, acc: &mut [u8], src: &[u8]) {
    match dtype {
        DType::I8 => ints::<i8, 1>(op, acc, src),
        DType::U8 => ints::<u8, 1>(op, acc, src),
        DType::I16 => ints::<i16, 2>(op, acc, src),
        DType::U16 => ints::<u16, 2>(op, acc, src),
        DType::I32 => ints::<i32, 4>(op, acc, src),
        DType::U32 => ints::<u32, 4>(op, acc, src),
        DType::I64 => ints::<i64, 8>(op, acc, src),
        DType::U64 => ints::<u64, 8>(op, acc, src),
        DType::F32 => floats(
            acc,
            src,
            4,
            op,
            |b| f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64,
            |v| (v as f32).to_le_bytes().to_vec(),
        ),
        DType::F64 => floats(
            acc,
            src,
            8,
            op,
            |b| f64::from_le_bytes(b.try_into().expect("8 bytes")),
            |v| v.to_le_bytes().to_vec(),
        ),
        DType::F16 => floats(
            acc,
            src,
            2,
            op,
            |b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
            |v| f32_to_f16(v as f32).to_le_bytes().to_vec(),
        ),
        DType::BF16 => floats(
            acc,
            src,
            2,
            op,
            |b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
            |v| f32_to_bf16(v as f32).to_le_bytes().to_vec(),
        ),
        // Refused before any data moves (`DType::reducible`).
        DType::F8E4M3 | DType::F8E5M2 => {}
    }
}

/// Scales every element of `buf` by `factor` in the element type (Avg's and PreMulSum's
/// pre-multiplication). Integers: only `divide` applies (the final division of Avg).
pub fn scale(dtype: DType, buf: &mut [u8], factor: f64) {
    let each = |size: usize, read: &dyn Fn(&[u8]) -> f64, write: &dyn Fn(f64) -> Vec<u8>, buf: &mut [u8]| {
        for chunk in buf.chunks_exact_mut(size) {
            let v = read(chunk) * factor;
            chunk.copy_from_slice(&write(v));
        }
    };
    match dtype {
        DType::F32 => each(
            4,
            &|b| f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64,
            &|v| ((v as f32).to_le_bytes()).to_vec(),
            buf,
        ),
        DType::F64 => {
            each(8, &|b| f64::from_le_bytes(b.try_into().expect("8 bytes")), &|v| v.to_le_bytes().to_vec(), buf)
        }
        DType::F16 => each(
            2,
            &|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
            &|v| f32_to_f16(v as f32).to_le_bytes().to_vec(),
            buf,
        ),
        DType::BF16 => each(
            2,
            &|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
            &|v| f32_to_bf16(v as f32).to_le_bytes().to_vec(),
            buf,
        ),
        _ => {}
    }
}

/// Divides every integer element of `buf` by `n`, truncating (Avg on integers).
pub fn divide_ints(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::I8 => div::<i8, 1>(buf, n),
        DType::U8 => div::<u8, 1>(buf, n),
        DType::I16 => div::<i16, 2>(buf, n),
        DType::U16 => div::<u16, 2>(buf, n),
        DType::I32 => div::<i32, 4>(buf, n),
        DType::U32 => div::<u32, 4>(buf, n),
        DType::I64 => div::<i64, 8>(buf, n),
        DType::U64 => div::<u64, 8>(buf, n),
        _ => {}
    }
}

trait Int: Copy + Ord {
    fn from_bytes(b: &[u8]) -> Self;
    fn to_bytes(self, out: &mut [u8]);
    fn wrapping_add(self, o: Self) -> Self;
    fn wrapping_mul(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! int_impl {
    ($($t:ty),*) => {$(
        impl Int for $t {
            fn from_bytes(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("element width"))
            }
            fn to_bytes(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn wrapping_add(self, o: Self) -> Self {
                <$t>::wrapping_add(self, o)
            }
            fn wrapping_mul(self, o: Self) -> Self {
                <$t>::wrapping_mul(self, o)
            }
            fn div_n(self, n: usize) -> Self {
                // n is a rank count (>= 1) and fits every type's positive range used here.
                self / (n as i128).try_into().unwrap_or(<$t>::MAX)
            }
        }
    )*};
}
int_impl!(i8, u8, i16, u16, i32, u32, i64, u64);

fn ints<T: Int, const N: usize>(op: RedOp, acc: &mut [u8], src: &[u8]) {
    for (a, s) in acc.chunks_exact_mut(N).zip(src.chunks_exact(N)) {
        let (x, y) = (T::from_bytes(a), T::from_bytes(s));
        let v = match op {
            RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_) => x.wrapping_add(y),
            RedOp::Prod => x.wrapping_mul(y),
            RedOp::Max => x.max(y),
            RedOp::Min => x.min(y),
        };
        v.to_bytes(a);
    }
}

fn div<T: Int, const N: usize>(buf: &mut [u8], n: usize) {
    for a in buf.chunks_exact_mut(N) {
        T::from_bytes(a).div_n(n).to_bytes(a);
    }
}

fn floats(
    acc: &mut [u8],
    src: &[u8],
    size: usize,
    op: RedOp,
    read: impl Fn(&[u8]) -> f64,
    write: impl Fn(f64) -> Vec<u8>,
) {
    for (a, s) in acc.chunks_exact_mut(size).zip(src.chunks_exact(size)) {
        let (x, y) = (read(a), read(s));
        // Each operation in f64 and then rounded to the element type is exact rounding of the
        // element-type operation for f32/f16/bf16 (f64 has more than twice their precision).
        let v = match op {
            RedOp::Sum | RedOp::Avg | RedOp::PreMulSum(_) => x + y,
            RedOp::Prod => x * y,
            // fmax/fmin: a NaN operand yields the other one, as the device's fmaxf does.
            RedOp::Max => x.max(y),
            RedOp::Min => x.min(y),
        };
        a.copy_from_slice(&write(v));
    }
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: normalise.
            let mut e = 127 - 15 + 1;
            let mut m = man;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Round to nearest, ties to even, with overflow to infinity and subnormals, as `__float2half_rn`.
pub fn f32_to_f16(f: f32) -> u16 {
    let bits = f.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let halfway = 1 << (shift - 1);
        let round = rem > halfway || (rem == halfway && half & 1 == 1);
        return sign | (half + round as u32) as u16;
    }
    let half = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let round = rem > 0x1000 || (rem == 0x1000 && half & 1 == 1);
    // A carry out of the mantissa correctly bumps the exponent (up to infinity).
    sign | (half + round as u32) as u16
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to nearest, ties to even, as `__float2bfloat16_rn`.
pub fn f32_to_bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    if f.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn integers_wrap_and_are_exact() {
        let mut acc = vec![250u8, 3];
        combine(DType::U8, RedOp::Sum, &mut acc, &[10, 4]);
        assert_eq!(acc, vec![4, 7]);
        let mut acc = (i64::MAX - 1).to_le_bytes().to_vec();
        combine(DType::I64, RedOp::Max, &mut acc, &i64::MAX.to_le_bytes());
        assert_eq!(acc, i64::MAX.to_le_bytes());
        let mut acc = 7i32.to_le_bytes().to_vec();
        divide_ints(DType::I32, &mut acc, 2);
        assert_eq!(acc, 3i32.to_le_bytes());
    }

    #[test]
    fn float_sums_round_at_every_step() {
        // 1 + 2^-24 + 2^-24 in f32 rank order: each addition rounds back to 1.0.
        let mut acc = f32s(&[1.0]);
        combine(DType::F32, RedOp::Sum, &mut acc, &f32s(&[2f32.powi(-24)]));
        combine(DType::F32, RedOp::Sum, &mut acc, &f32s(&[2f32.powi(-24)]));
        assert_eq!(acc, f32s(&[1.0]));
    }

    #[test]
    fn half_and_bfloat16_round_trip_and_round_to_even() {
        for v in [0.0f32, 1.0, -2.5, 65504.0, 6.1035156e-05, 5.9604645e-08] {
            assert_eq!(f16_to_f32(f32_to_f16(v)), v, "{v}");
        }
        assert_eq!(f32_to_f16(70000.0), 0x7c00);
        // 1 + 2^-11 is halfway between two halves: ties to the even one (1.0).
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(f32_to_bf16(3.140625)), 3.140625);
        // 1 + 2^-8 is halfway in bfloat16: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        let mut acc = f32_to_f16(1.5).to_le_bytes().to_vec();
        combine(DType::F16, RedOp::Sum, &mut acc, &f32_to_f16(2.25).to_le_bytes());
        assert_eq!(f16_to_f32(u16::from_le_bytes([acc[0], acc[1]])), 3.75);
    }

    #[test]
    fn float_average_premultiplies() {
        let mut buf = f32s(&[3.0, 5.0]);
        scale(DType::F32, &mut buf, 0.5);
        assert_eq!(buf, f32s(&[1.5, 2.5]));
    }
}
