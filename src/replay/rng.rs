//! The table's random numbers: xoshiro256++ (Blackman and Vigna), seeded through splitmix64.
//! Small, fast, statistically strong for sampling, and reproducible from a `u64` seed. Not
//! for anything security related.

use std::hash::{BuildHasher, Hasher};

/// A xoshiro256++ generator.
#[derive(Debug, Clone)]
pub(crate) struct Rng {
    s: [u64; 4],
}

/// One splitmix64 step: advances `state` and returns a well-mixed output.
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator whose whole sequence is fixed by `seed`.
    pub(crate) fn from_seed(seed: u64) -> Self {
        let mut state = seed;
        let s = [(); 4].map(|()| splitmix64(&mut state));
        // splitmix64 is a bijection of a counter, so four consecutive outputs are never all
        // zero (the one state xoshiro must avoid).
        Self { s }
    }

    /// A generator seeded from the process's hash randomness (different on every run).
    pub(crate) fn from_entropy() -> Self {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(0x6563_686f); // "echo"
        Self::from_seed(hasher.finish())
    }

    /// The generator's whole state (for a checkpoint).
    pub(crate) fn state(&self) -> [u64; 4] {
        self.s
    }

    /// A generator that continues from `state` (from [`Rng::state`]); `None` for the all-zero
    /// state, which xoshiro can never leave and never produces.
    pub(crate) fn from_state(state: [u64; 4]) -> Option<Self> {
        (state != [0; 4]).then_some(Self { s: state })
    }

    /// The next 64 random bits.
    #[inline]
    pub(crate) fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    #[inline]
    pub(crate) fn next_f64(&mut self) -> f64 {
        #[allow(clippy::cast_precision_loss)] // 53 bits convert exactly
        let mantissa = (self.next_u64() >> 11) as f64;
        mantissa * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`) by a widening multiply; the bias is below `n / 2^64`.
    #[inline]
    pub(crate) fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_different_seeds_differ() {
        let (mut a, mut b, mut c) = (Rng::from_seed(7), Rng::from_seed(7), Rng::from_seed(8));
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..8).map(|_| c.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }

    #[test]
    fn a_generator_restored_from_its_state_continues_the_sequence() {
        let mut a = Rng::from_seed(9);
        a.next_u64();
        let mut b = Rng::from_state(a.state()).unwrap();
        assert_eq!(
            (0..4).map(|_| a.next_u64()).collect::<Vec<_>>(),
            (0..4).map(|_| b.next_u64()).collect::<Vec<_>>()
        );
        assert!(Rng::from_state([0; 4]).is_none());
    }

    #[test]
    fn floats_lie_in_the_unit_interval_and_average_one_half() {
        let mut rng = Rng::from_seed(1);
        let n = 200_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let x = rng.next_f64();
            assert!((0.0..1.0).contains(&x));
            sum += x;
        }
        // The mean of n uniforms has standard deviation 1/sqrt(12 n) ~ 6.5e-4: 6 sigma.
        assert!((sum / f64::from(n) - 0.5).abs() < 4e-3, "mean {}", sum / f64::from(n));
    }

    #[test]
    fn below_covers_every_value_and_nothing_else() {
        let mut rng = Rng::from_seed(2);
        let mut seen = [0u32; 7];
        for _ in 0..7_000 {
            seen[rng.below(7)] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800), "{seen:?}");
    }
}
