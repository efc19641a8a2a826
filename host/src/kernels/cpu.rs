//! Run-time CPU feature detection: which kernel family to use, and the
//! `HOST_CPU_KERNELS` override that forces one for tests and benchmarks.

use std::sync::OnceLock;

/// The environment variable that forces a kernel family: `scalar`, `avx2`,
/// `avxvnni`, `avx512vnni`, `amx`, or `auto` (the default: the fastest the
/// CPU supports).
pub const KERNELS_ENV: &str = "HOST_CPU_KERNELS";

/// A family of CPU kernels. The quantized matmuls of every family compute
/// bit-identical results (they reproduce the scalar path's float order
/// exactly), so for them the choice changes speed only; the other SIMD
/// kernels (norms, softmax, SiLU, dot) match scalar within a tolerance.
/// Ordered by preference; both VNNI families
/// include AVX2 (they run the AVX2 kernels for everything that has no VNNI
/// version), but neither implies the other (Ice Lake has AVX-512 VNNI and
/// no AVX-VNNI; Alder Lake the reverse).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuKernels {
    /// Portable Rust, the reference every SIMD version is tested against.
    Scalar,
    /// AVX2 + FMA + F16C (`maddubs`/`madd` integer dot products).
    Avx2,
    /// AVX2's set plus AVX-VNNI: the AVX2 quantized matmuls with the
    /// 256-bit `vpdpbusd` in place of `maddubs` + `madd`.
    AvxVnni,
    /// AVX2's set plus AVX-512 F/BW/VL and VNNI (512-bit `vpdpbusd` integer
    /// dot products) for the quantized matmuls.
    Avx512Vnni,
    /// AVX-512 VNNI's set plus AMX int8 tiles (`tdpbssd`, 16 × 16 × 32
    /// per instruction) for quantized matmuls of 16 tokens or more; needs
    /// Linux's permission for tile state, which detection asks for.
    Amx,
}

impl CpuKernels {
    /// Every family, slowest first.
    pub const ALL: [CpuKernels; 5] = [
        CpuKernels::Scalar,
        CpuKernels::Avx2,
        CpuKernels::AvxVnni,
        CpuKernels::Avx512Vnni,
        CpuKernels::Amx,
    ];

    /// The name `HOST_CPU_KERNELS` accepts.
    pub fn name(self) -> &'static str {
        match self {
            CpuKernels::Scalar => "scalar",
            CpuKernels::Avx2 => "avx2",
            CpuKernels::AvxVnni => "avxvnni",
            CpuKernels::Avx512Vnni => "avx512vnni",
            CpuKernels::Amx => "amx",
        }
    }

    /// True when this CPU can run the family.
    pub fn is_supported(self) -> bool {
        match self {
            CpuKernels::Scalar => true,
            CpuKernels::Avx2 => has_avx2_fma_f16c(),
            CpuKernels::AvxVnni => has_avx2_fma_f16c() && has_avx_vnni(),
            CpuKernels::Avx512Vnni => has_avx2_fma_f16c() && has_avx512_vnni(),
            CpuKernels::Amx => has_avx2_fma_f16c() && has_avx512_vnni() && has_amx_int8(),
        }
    }

    /// How many rows the family wants interleaved in its quantized matrices
    /// (`Packed::Q4Interleaved`, `Packed::Q8Interleaved`), or `None` for
    /// row after row. The interleaved kernels need no horizontal sums and
    /// read one stream per group: AVX2 takes groups of 8 rows (one row per
    /// 32-bit lane of a 256-bit vector), AVX-512 VNNI groups of 16, which
    /// are also AMX's weight tiles. AVX-VNNI keeps its row-major kernels
    /// (not measured on a machine with it).
    pub fn interleave_group(self) -> Option<usize> {
        match self {
            CpuKernels::Avx2 => Some(super::interleaved::AVX2_GROUP),
            CpuKernels::Avx512Vnni | CpuKernels::Amx => Some(super::interleaved::AVX512_GROUP),
            CpuKernels::Scalar | CpuKernels::AvxVnni => None,
        }
    }

    /// The families this CPU supports, slowest first.
    pub fn available() -> Vec<CpuKernels> {
        CpuKernels::ALL
            .into_iter()
            .filter(|k| k.is_supported())
            .collect()
    }

    /// The family `HOST_CPU_KERNELS` asks for (the fastest available when
    /// it is unset or `auto`), or an error naming the value and the
    /// families this CPU supports. The command line calls this before
    /// anything runs, so a bad value is a clean error, never a panic.
    pub fn from_env() -> Result<CpuKernels, String> {
        let value = std::env::var(KERNELS_ENV).ok();
        choose(value.as_deref(), &CpuKernels::available())
    }

    /// The family in use: [`CpuKernels::from_env`], read once per process.
    ///
    /// Panics (at the first kernel call) if `HOST_CPU_KERNELS` names an
    /// unknown family or one this CPU lacks and nothing checked it first
    /// (the `host` command does): a forced path exists for tests and
    /// benchmarks, which must not silently measure another path.
    pub fn active() -> CpuKernels {
        static ACTIVE: OnceLock<CpuKernels> = OnceLock::new();
        *ACTIVE.get_or_init(|| CpuKernels::from_env().unwrap_or_else(|e| panic!("{e}")))
    }
}

/// The CPU flags (as Linux's /proc/cpuinfo spells them) that decide which
/// kernels can run or could run, so a benchmark says where it came from:
/// x86-64's, then aarch64's (NEON, its dot products and int8 matrix
/// multiplies, SVE), which a kernel family for ARM would build on.
const FLAGS_OF_INTEREST: [&str; 17] = [
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
    "bf16",
    "sve",
    "sve2",
];

/// ARM server cores by /proc/cpuinfo's `CPU implementer` and `CPU part`
/// (the MIDR fields): aarch64 Linux prints no `model name`. Others are
/// named by their numbers.
const ARM_PARTS: [(&str, &str, &str); 6] = [
    ("0x41", "0xd0c", "Neoverse-N1"),
    ("0x41", "0xd40", "Neoverse-V1"),
    ("0x41", "0xd49", "Neoverse-N2"),
    ("0x41", "0xd4f", "Neoverse-V2"),
    ("0xc0", "0xac3", "Ampere-1"),
    ("0xc0", "0xac4", "Ampere-1a"),
];

/// ARM implementers (the MIDR's top byte) that make server cores.
const ARM_IMPLEMENTERS: [(&str, &str); 5] = [
    ("0x41", "ARM"),
    ("0x48", "HiSilicon"),
    ("0x4e", "NVIDIA"),
    ("0x61", "Apple"),
    ("0xc0", "Ampere"),
];

/// The CPU's model name and which of the kernel-relevant flags it has,
/// from /proc/cpuinfo (`None` where that file is missing, as off Linux).
pub fn cpu_description() -> Option<(String, Vec<&'static str>)> {
    describe_cpu(&std::fs::read_to_string("/proc/cpuinfo").ok()?)
}

/// [`cpu_description`] of the text of a /proc/cpuinfo: x86-64's `model
/// name` and `flags`, or aarch64's `CPU implementer`, `CPU part` and
/// `Features`.
fn describe_cpu(cpuinfo: &str) -> Option<(String, Vec<&'static str>)> {
    let field = |key: &str| {
        cpuinfo.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let name = match field("model name") {
        Some(name) => name,
        None => arm_name(&field("CPU implementer")?, &field("CPU part")?),
    };
    let flags = field("flags")
        .or_else(|| field("Features"))
        .unwrap_or_default();
    let has: Vec<&str> = flags.split_whitespace().collect();
    let wanted = FLAGS_OF_INTEREST.into_iter().filter(|f| has.contains(f));
    Some((name, wanted.collect()))
}

/// An ARM core's name from its implementer and part numbers, as lscpu
/// would print it, or the numbers where the tables above lack it.
fn arm_name(implementer: &str, part: &str) -> String {
    let vendor = ARM_IMPLEMENTERS.iter().find(|(id, _)| *id == implementer);
    let core = ARM_PARTS
        .iter()
        .find(|(i, p, _)| *i == implementer && *p == part);
    match (vendor, core) {
        (Some((_, vendor)), Some((_, _, core))) => format!("{vendor} {core}"),
        (Some((_, vendor)), None) => format!("{vendor} part {part}"),
        (None, _) => format!("ARM implementer {implementer} part {part}"),
    }
}

/// The family `value` (the environment variable, if set) asks for, given the
/// families the CPU supports (slowest first, never empty).
fn choose(value: Option<&str>, available: &[CpuKernels]) -> Result<CpuKernels, String> {
    let fastest = *available.last().expect("scalar is always available");
    let names = |ks: &[CpuKernels]| ks.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ");
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(fastest),
        Some(v) => match CpuKernels::ALL.into_iter().find(|k| k.name() == v) {
            Some(k) if available.contains(&k) => Ok(k),
            Some(k) => Err(format!(
                "{KERNELS_ENV}={v}, but this CPU cannot run the {} kernels; it supports: {}. Unset {KERNELS_ENV} or pick one of those",
                k.name(),
                names(available)
            )),
            None => Err(format!(
                "{KERNELS_ENV}={v:?} is not a kernel family; use auto or one of: {}",
                names(&CpuKernels::ALL)
            )),
        },
    }
}

/// True when the active family includes the AVX2 + FMA + F16C kernels.
///
/// After the first call this is a relaxed load and a compare.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2() -> bool {
    CpuKernels::active() >= CpuKernels::Avx2
}

/// True when the active family includes the AVX-512 F/BW/VL kernels.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx512() -> bool {
    CpuKernels::active() >= CpuKernels::Avx512Vnni
}

/// The AVX2 family's CPU features (`is_x86_feature_detected!` caches them).
#[cfg(target_arch = "x86_64")]
fn has_avx2_fma_f16c() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX-VNNI family's extra CPU feature.
#[cfg(target_arch = "x86_64")]
fn has_avx_vnni() -> bool {
    is_x86_feature_detected!("avxvnni")
}

/// The AVX-512 VNNI family's extra CPU features.
#[cfg(target_arch = "x86_64")]
fn has_avx512_vnni() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// The AMX family's extra CPU features (CPUID leaf 7: AMX-TILE, AMX-INT8;
/// the standard library's detection of them is not stable) and this
/// process's permission to use tile state, asked for once.
#[cfg(target_arch = "x86_64")]
fn has_amx_int8() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        // SAFETY: CPUID leaf 7 exists on every x86-64 CPU with AVX2, which
        // the callers check first.
        #[allow(unused_unsafe)]
        let edx = unsafe { std::arch::x86_64::__cpuid_count(7, 0) }.edx;
        let (tile, int8) = (edx >> 24 & 1 == 1, edx >> 25 & 1 == 1);
        tile && int8 && super::gemm_amx::request_permission()
    })
}

/// Other architectures run the portable scalar kernels.
#[cfg(not(target_arch = "x86_64"))]
fn has_amx_int8() -> bool {
    false
}

/// Other architectures run the portable scalar kernels.
#[cfg(not(target_arch = "x86_64"))]
fn has_avx2_fma_f16c() -> bool {
    false
}

/// Other architectures run the portable scalar kernels.
#[cfg(not(target_arch = "x86_64"))]
fn has_avx_vnni() -> bool {
    false
}

/// Other architectures run the portable scalar kernels.
#[cfg(not(target_arch = "x86_64"))]
fn has_avx512_vnni() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use CpuKernels::*;

    #[test]
    fn the_override_picks_a_supported_family_or_explains() {
        let all = [Scalar, Avx2, AvxVnni, Avx512Vnni, Amx];
        assert_eq!(choose(None, &all), Ok(Amx));
        assert_eq!(choose(None, &all[..4]), Ok(Avx512Vnni));
        assert_eq!(choose(Some("auto"), &[Scalar, Avx2]), Ok(Avx2));
        assert_eq!(choose(Some("auto"), &[Scalar, Avx2, AvxVnni]), Ok(AvxVnni));
        assert_eq!(choose(Some("avxvnni"), &all), Ok(AvxVnni));
        assert_eq!(choose(Some(" avx2 "), &all), Ok(Avx2));
        assert_eq!(choose(Some("scalar"), &[Scalar]), Ok(Scalar));
        let e = choose(Some("avx512vnni"), &[Scalar, Avx2]).unwrap_err();
        assert!(
            e.contains("cannot run the avx512vnni kernels") && e.contains("scalar, avx2"),
            "{e}"
        );
        let e = choose(Some("neon"), &all).unwrap_err();
        assert!(e.contains("\"neon\" is not a kernel family"), "{e}");
    }

    #[test]
    fn the_cpu_is_described_from_cpuinfo() {
        let text = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n\
                    flags\t\t: fpu sse avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8\n\n\
                    processor\t: 1\nmodel name\t: ignored\n";
        let (name, flags) = describe_cpu(text).unwrap();
        assert_eq!(name, "Intel(R) Xeon(R) Platinum 8481C");
        assert_eq!(
            flags,
            [
                "avx2",
                "fma",
                "f16c",
                "avx512f",
                "avx512_vnni",
                "amx_tile",
                "amx_int8"
            ]
        );
        assert_eq!(describe_cpu("flags: avx2\n"), None);
    }

    #[test]
    fn an_arm_cpu_is_described_from_its_part_numbers() {
        // An AWS Graviton3's /proc/cpuinfo, first processor.
        let graviton3 = "processor\t: 0\nBogoMIPS\t: 2100.00\n\
                         Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp \
                         asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 \
                         sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 \
                         i8mm bf16 dgh rng\n\
                         CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\n\
                         CPU part\t: 0xd40\nCPU revision\t: 1\n";
        let (name, flags) = describe_cpu(graviton3).unwrap();
        assert_eq!(name, "ARM Neoverse-V1");
        assert_eq!(flags, ["asimd", "asimddp", "i8mm", "bf16", "sve"]);
        let part = |i, p| {
            describe_cpu(&format!("CPU implementer: {i}\nCPU part: {p}\n"))
                .unwrap()
                .0
        };
        assert_eq!(part("0xc0", "0xac3"), "Ampere Ampere-1");
        assert_eq!(part("0x41", "0xd8e"), "ARM part 0xd8e");
        assert_eq!(part("0x99", "0x001"), "ARM implementer 0x99 part 0x001");
        assert_eq!(describe_cpu("CPU implementer: 0x41\n"), None);
    }

    #[test]
    fn detection_is_consistent() {
        let available = CpuKernels::available();
        assert_eq!(available[0], Scalar);
        assert!(available.contains(&CpuKernels::active()));
        // In preference order, and every SIMD family includes AVX2.
        assert!(available.windows(2).all(|w| w[0] < w[1]));
        assert!(available.len() < 3 || available[1] == Avx2);
        // AMX's kernel runs AVX-512 VNNI's for small batches.
        assert!(!available.contains(&Amx) || available.contains(&Avx512Vnni));
        assert_eq!(
            available.len(),
            CpuKernels::ALL.iter().filter(|k| k.is_supported()).count()
        );
    }
}
