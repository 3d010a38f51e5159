//! What a captured step's fuser may do with a launch: the descriptors an op gives with its
//! launch (through `kernel::Launch::fusible`; `kernel` re-exports them), once, generic over how
//! they name the buffers involved. They live beside the tape, which records them. An op names them by binding
//! (`Fusion<u32>`, as it launches); the capture draft renames them to the step's values
//! (`Fusion<usize>`) with [`Fusion::named`], and the fuser decides on those.

use crate::tensor::Layout;

/// What an elementwise launch computes: `out[i] = f(operands at i, scalars)` over a contiguous
/// output, where `f` is a WGSL expression.
pub(crate) struct Elementwise<N> {
    /// The expression's parameters, e.g. `"a: f32, b: f32, s: f32"`: one per operand, then
    /// one per scalar.
    pub params: &'static str,
    /// The expression, e.g. `"a * b"`.
    pub expr: String,
    /// The scalar arguments.
    pub scalars: Vec<f32>,
    /// Each operand and its layout, expanded to the output's shape.
    pub operands: Vec<(N, Layout)>,
    /// The output (a fresh contiguous tensor of `shape`).
    pub output: N,
    pub shape: Vec<usize>,
}

/// A launch that can run the elementwise ops consuming its output inside its own stores
/// (matmul, LayerNorm): the fuser replaces the `EPILOGUE SECTION` of its pipeline's module
/// source.
pub(crate) struct EpilogueSite<N> {
    /// The entry point.
    pub entry: &'static str,
    /// The output: a fresh dense tensor of `numel` elements, each stored once.
    pub output: N,
    pub numel: usize,
    /// Whether the module binds the output as vec4s (and stores through `store4` and
    /// `store1`) rather than as f32s (`store1` only).
    pub vec4_output: bool,
}

/// A launch that runs one function of its family's MEMBER SECTION (`part`) over its own
/// workgroups, which the fuser may merge with the next launches of the same pipeline (an
/// optimizer's update of each parameter, the reductions of a backward pass) into one launch
/// that repeats the section per member.
pub(crate) struct MergeSite {
    pub part: &'static str,
    /// The param slots the launch's params take.
    pub param_slots: usize,
}

/// What the fuser may do with a launch, naming buffers by `N`.
pub(crate) enum Fusion<N> {
    /// Merge it with the elementwise launches around it.
    Elementwise(Elementwise<N>),
    /// Run the elementwise launches that consume its output in its stores.
    Epilogue(EpilogueSite<N>),
    /// Merge it with the next launches of the same pipeline.
    Merge(MergeSite),
}

impl<N> Fusion<N> {
    /// The same descriptor with every buffer named by `name` instead.
    pub fn named<M>(self, mut name: impl FnMut(N) -> M) -> Fusion<M> {
        match self {
            Fusion::Elementwise(e) => Fusion::Elementwise(Elementwise {
                params: e.params,
                expr: e.expr,
                scalars: e.scalars,
                operands: (e.operands.into_iter())
                    .map(|(n, layout)| (name(n), layout))
                    .collect(),
                output: name(e.output),
                shape: e.shape,
            }),
            Fusion::Epilogue(site) => Fusion::Epilogue(EpilogueSite {
                entry: site.entry,
                output: name(site.output),
                numel: site.numel,
                vec4_output: site.vec4_output,
            }),
            Fusion::Merge(site) => Fusion::Merge(site),
        }
    }
}
