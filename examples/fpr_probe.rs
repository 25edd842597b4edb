fn main() {
    let n = 1_000_000u64;
    for p in [0.1, 0.01, 0.001] {
        let mut total = 0f64;
        for seed in 0..4u64 {
            let f = bloomguard::AtomicBloom::with_seed(n, p, seed).unwrap();
            for i in 0..n {
                f.insert(format!("user:{}:item:{}", i / 97, i));
            }
            let probes = 20_000_000u64;
            let hits = (0..probes)
                .filter(|i| f.contains(format!("absent:{i}")))
                .count();
            let fpr = hits as f64 / probes as f64;
            total += fpr;
            println!(
                "p={p} seed={seed} fpr={fpr:.6} model={:.6}",
                f.stats().estimated_fpr
            );
        }
        println!("p={p} mean ratio {:.4}", total / 4.0 / p);
    }
}
