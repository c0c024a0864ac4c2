//! Which way the bf16 products run: detected from the CPU, named for the process
//! (`FLASHGRPO_BF16_PRODUCTS`), per thread ([`with_bf16_products`]) or per call ([`Bf16Choice`]).

use std::cell::Cell;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use super::{amx, dpbf16};
use crate::error::LossError;

/// The kernels the bf16 products run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bf16Products {
    /// bf16 operands widened to f32 for the f32 products.
    #[default]
    Widened,
    /// AMX-BF16 tiles, the logits' gradient split into two bf16 numbers (f32-grade gradients).
    Amx,
    /// AMX-BF16 tiles, the logits' gradient rounded to bf16 as PyTorch and Liger take it: the
    /// gradient products at half the flops, with bf16-grade gradients (named, or the default of the
    /// front ends that hand bf16 gradients back: [`Bf16Choice::default_for`]).
    AmxRounded,
    /// AVX512-BF16 (`vdpbf16ps`), the gradient split as [`Bf16Products::Amx`].
    Avx512Bf16,
    /// AVX512-BF16, the gradient rounded as [`Bf16Products::AmxRounded`] (named, or the same
    /// front ends' default on a CPU without AMX).
    Avx512Bf16Rounded,
}

impl Bf16Products {
    /// AMX where the CPU and the kernel allow it, else AVX512-BF16 where the CPU has it, else
    /// widened, unless `FLASHGRPO_BF16_PRODUCTS` names another way this machine has (`widened`,
    /// `amx`, `amx-rounded`, `avx512-bf16`, `avx512-bf16-rounded`; one it lacks is ignored).
    pub fn detected() -> Self {
        static DETECTED: OnceLock<Bf16Products> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let available = Self::available();
            let default = *available.iter().find(|p| !p.rounded()).expect("one way at least");
            let named = Self::named_by_environment();
            let wanted = std::env::var("FLASHGRPO_BF16_PRODUCTS").unwrap_or_default();
            if named.is_none() && !wanted.is_empty() {
                let ways: Vec<&str> = available.iter().map(|p| p.setting()).collect();
                eprintln!(
                    "flashgrpo: FLASHGRPO_BF16_PRODUCTS={wanted} is not a way this machine has (it has: {}); using {}",
                    ways.join(", "),
                    default.setting()
                );
            }
            named.unwrap_or(default)
        })
    }

    /// The way `FLASHGRPO_BF16_PRODUCTS` names, if this machine has it (a value naming none is
    /// ignored). Public so that tests outside the crate follow the same rule.
    pub fn named_by_environment() -> Option<Self> {
        let wanted = std::env::var("FLASHGRPO_BF16_PRODUCTS").unwrap_or_default();
        Self::available().into_iter().find(|p| p.setting() == wanted)
    }

    /// Whether the products run on the packed bf16 kernels (AMX or AVX512-BF16).
    pub fn packed(self) -> bool {
        self != Bf16Products::Widened
    }

    /// Whether the gradient products take the logits' gradient rounded to bf16.
    pub fn rounded(self) -> bool {
        matches!(self, Bf16Products::AmxRounded | Bf16Products::Avx512Bf16Rounded)
    }

    /// Whether the products run on AMX tiles.
    pub fn on_amx(self) -> bool {
        matches!(self, Bf16Products::Amx | Bf16Products::AmxRounded)
    }

    /// Every way this machine can run, fastest first.
    pub fn available() -> Vec<Self> {
        let mut all = vec![];
        if amx::available() {
            all.extend([Bf16Products::Amx, Bf16Products::AmxRounded]);
        }
        if dpbf16::available() {
            all.extend([Bf16Products::Avx512Bf16, Bf16Products::Avx512Bf16Rounded]);
        }
        all.push(Bf16Products::Widened);
        all
    }

    /// The value of `FLASHGRPO_BF16_PRODUCTS` that asks for this way.
    pub fn setting(self) -> &'static str {
        match self {
            Bf16Products::Widened => "widened",
            Bf16Products::Amx => "amx",
            Bf16Products::AmxRounded => "amx-rounded",
            Bf16Products::Avx512Bf16 => "avx512-bf16",
            Bf16Products::Avx512Bf16Rounded => "avx512-bf16-rounded",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Bf16Products::Widened => "widened-f32",
            Bf16Products::Amx => "amx-bf16",
            Bf16Products::AmxRounded => "amx-bf16-rounded-gradient",
            Bf16Products::Avx512Bf16 => "avx512-bf16",
            Bf16Products::Avx512Bf16Rounded => "avx512-bf16-rounded-gradient",
        }
    }
}

thread_local! {
    static OVERRIDE: Cell<Option<Bf16Products>> = const { Cell::new(None) };
}

/// Runs `f` with the bf16 products of `products` for calls made from this thread.
///
/// # Panics
/// If this machine cannot run `products`.
pub fn with_bf16_products<R>(products: Bf16Products, f: impl FnOnce() -> R) -> R {
    assert!(Bf16Products::available().contains(&products), "this machine cannot run {products:?}");
    /// Puts the thread's previous way back when dropped, also when `f` panics and the panic is
    /// caught (a test's `catch_unwind`, a Python call's error), so the way does not leak.
    struct Restore(Option<Bf16Products>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(products))));
    f()
}

/// The way calls from this thread run now.
pub fn current() -> Bf16Products {
    OVERRIDE.with(Cell::get).unwrap_or_else(Bf16Products::detected)
}

/// A call's or a config's choice of bf16 products (`bf16_products`), carried by
/// [`ChunkBudget`](crate::ChunkBudget) so that every front end, and a deferred backward, runs the
/// way its forward ran: `auto` ([`current`]: the machine's fastest way with f32-grade gradients,
/// or what `FLASHGRPO_BF16_PRODUCTS` names), `rounded` (the machine's fastest way with the logits'
/// gradient rounded to bf16, as PyTorch and Liger take it; kept by that name, so a config written
/// on one CPU reads on another), or one way's setting. Checked against this machine when read: a
/// way it lacks is an error naming the ones it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Bf16Choice {
    #[default]
    Auto,
    Rounded,
    Way(Bf16Products),
}

impl Bf16Choice {
    pub fn parse(setting: &str) -> Result<Self, LossError> {
        let available = Bf16Products::available();
        let choice = match setting {
            "auto" => Some(Bf16Choice::Auto),
            "rounded" => available.iter().any(|p| p.rounded()).then_some(Bf16Choice::Rounded),
            _ => available.iter().find(|p| p.setting() == setting).map(|&p| Bf16Choice::Way(p)),
        };
        choice.ok_or_else(|| {
            let ways: Vec<&str> = available.iter().map(|p| p.setting()).collect();
            let packed = available.iter().any(|p| p.packed());
            LossError::InvalidOption {
                name: "bf16_products",
                message: format!(
                    "`{setting}` is not a way this machine has; it has: auto, {}{}{}",
                    if packed { "rounded, " } else { "" },
                    ways.join(", "),
                    if packed { "" } else { " (this CPU has neither AMX nor AVX512-BF16)" }
                ),
            }
        })
    }

    /// What a front end runs when its caller names no way: `rounded` where every gradient it hands
    /// back is bf16 (`bf16_gradients`: `flashgrpo loss`, PyTorch and JAX on bf16 inputs), else
    /// `auto`. Rounding those gradients to bf16 already costs them ~1.7e-3 relative (norm);
    /// taking the logits' gradient rounded too brings that to ~2.4e-3, about Liger-Kernel's and
    /// below PyTorch eager's own bf16 error, for half the gradient products' flops
    /// (docs/BENCHMARKS.md, "The front ends' bf16 default"), while the library's f32 gradients
    /// and the trainer's f32 master weights keep f32-grade products.
    /// `FLASHGRPO_BF16_PRODUCTS` naming a way this machine has, or a way this thread runs under
    /// ([`with_bf16_products`]), still decides (`auto`); so does a CPU with no rounded way.
    pub fn default_for(bf16_gradients: bool) -> Self {
        let named = OVERRIDE.with(Cell::get).is_some() || Bf16Products::named_by_environment().is_some();
        let rounded_here = Bf16Products::available().iter().any(|p| p.rounded());
        if bf16_gradients && rounded_here && !named {
            Bf16Choice::Rounded
        } else {
            Bf16Choice::Auto
        }
    }

    /// The way a call runs: the one chosen, else this thread's ([`current`]).
    pub fn resolve(self) -> Bf16Products {
        match self {
            Bf16Choice::Auto => current(),
            Bf16Choice::Rounded => Bf16Products::available().into_iter().find(|p| p.rounded()).unwrap_or_else(current),
            Bf16Choice::Way(p) => p,
        }
    }

    /// Runs `f` with this choice as the calling thread's way (`auto`: as it is), for what reads
    /// the thread's way rather than a budget: the bench's product rate, a training run's layers.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self {
            Bf16Choice::Auto => f(),
            choice => with_bf16_products(choice.resolve(), f),
        }
    }

    pub fn setting(self) -> &'static str {
        match self {
            Bf16Choice::Auto => "auto",
            Bf16Choice::Rounded => "rounded",
            Bf16Choice::Way(p) => p.setting(),
        }
    }
}

impl TryFrom<String> for Bf16Choice {
    type Error = LossError;

    fn try_from(setting: String) -> Result<Self, LossError> {
        Self::parse(&setting)
    }
}

impl From<Bf16Choice> for String {
    fn from(choice: Bf16Choice) -> String {
        choice.setting().to_string()
    }
}
