//! Every CPU kernel family this machine has computes the scalar family's
//! bits on the real SmolLM2 weights (the unit tests check random weights of
//! the same shapes): Q4_1 projections of the first and last layer and the
//! Q8_0 embedding that serves as LM head, each in the layout its family
//! repacks it to at load, for a decode-sized batch, AMX's smallest tile
//! batch and a batch with a partial tile, on a pool of worker threads.

use e2e::default_model;
use host::kernels::{matmul_on, CpuKernels, MatmulPath, ThreadPool, WeightMatrix};
use host::model::{load, LoadFormat};

/// Activations like a block's input: normal-ish values with a few large
/// ones, from a fixed seed.
fn activations(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|i| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 97 == 0 {
                40.0 * u
            } else {
                2.0 * u
            }
        })
        .collect()
}

#[test]
fn every_kernel_family_equals_scalar_on_the_real_weights() {
    let weights = load(&default_model(), LoadFormat::Auto).unwrap();
    let (first, last) = (&weights.layers[0], &weights.layers[29]);
    let tensors = [
        (&first.wq, &[1, 16, 40][..]),
        (&first.w_gate, &[1, 16, 40]),
        (&last.w_down, &[1, 16, 40]),
        (&weights.embed, &[1, 17]),
    ];
    let pool = ThreadPool::new(3);
    let families = CpuKernels::available();
    for (t, sizes) in tensors {
        let reference = WeightMatrix::from_tensor_for(t, CpuKernels::Scalar).unwrap();
        for &n in sizes {
            let x = activations(n * t.cols(), n as u64);
            let mut want = vec![0f32; n * t.rows()];
            let scalar = CpuKernels::Scalar;
            matmul_on(
                &pool,
                &reference,
                &x,
                n,
                &mut want,
                MatmulPath::Auto,
                scalar,
            );
            for &kernels in &families[1..] {
                let w = WeightMatrix::from_tensor_for(t, kernels).unwrap();
                let mut got = vec![f32::NAN; n * t.rows()];
                matmul_on(&pool, &w, &x, n, &mut got, MatmulPath::Auto, kernels);
                let first = got
                    .iter()
                    .zip(&want)
                    .position(|(g, w)| g.to_bits() != w.to_bits());
                if let Some(i) = first {
                    panic!(
                        "{} ({:?}) on {kernels:?} with {n} tokens: element {i} is {} where scalar gives {}",
                        t.name, t.dtype, got[i], want[i]
                    );
                }
            }
        }
    }
}
