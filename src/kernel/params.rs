//! Typed kernel parameters. Each kernel's parameters are one `#[repr(C)]` struct declared with
//! [`kernel_params!`](crate::kernel_params); the same declaration gives the WGSL side a named
//! slot constant per field (`CAST_RANK`, `CAST_SHAPE`, ...), so the layout is written once.
//!
//! Kernels read a field with `pu(CAST_RANK)` (or `pf` for an f32) and an array element with
//! `pu(CAST_SHAPE + d)`: every read goes through `pu` in `shaders/common.wgsl`, whose opaque
//! index keeps software drivers from inlining parameter values and recompiling per dispatch.

/// Slots (u32s) a kernel may use: 63, the 64th is `pu`'s opaque zero.
pub(crate) const MAX_SLOTS: usize = 63;

/// The layout of one params struct: its name and each field's name and length in slots.
pub(crate) struct ParamsLayout {
    /// The Rust struct's name, e.g. `UnaryParams`.
    pub name: &'static str,
    /// `(field, slots)` in declaration order.
    pub fields: &'static [(&'static str, usize)],
}

impl ParamsLayout {
    /// WGSL constants naming each field's first slot: `const CAST_RANK: u32 = 2u;` for field
    /// `rank` of `CastParams`.
    pub fn wgsl_slots(&self) -> String {
        let prefix = upper_snake(self.name.strip_suffix("Params").unwrap_or(self.name));
        let mut out = format!("// {}: slot of each field.\n", self.name);
        let mut slot = 0;
        for (field, len) in self.fields {
            out.push_str(&format!(
                "const {prefix}_{}: u32 = {slot}u;\n",
                field.to_ascii_uppercase()
            ));
            slot += len;
        }
        out
    }
}

/// `MatmulTile` -> `MATMUL_TILE`.
fn upper_snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// A kernel's parameter block: plain 32-bit fields, uploaded as they lie in memory.
pub(crate) trait KernelParams: bytemuck::Pod {
    /// The field layout, for the WGSL slot constants.
    const LAYOUT: ParamsLayout;
}

/// Declares a kernel's params struct (fields `u32`, `f32` or `[u32; N]`) and its
/// [`ParamsLayout`]. Fails to compile when the struct needs more than [`MAX_SLOTS`] slots.
#[macro_export]
#[doc(hidden)]
macro_rules! kernel_params {
    ($(#[$meta:meta])* $vis:vis struct $name:ident {
        $($(#[$fmeta:meta])* $field:ident : $ty:ty),* $(,)?
    }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $($(#[$fmeta])* pub $field: $ty),*
        }

        impl $crate::kernel::KernelParams for $name {
            const LAYOUT: $crate::kernel::ParamsLayout = $crate::kernel::ParamsLayout {
                name: stringify!($name),
                fields: &[$((stringify!($field), std::mem::size_of::<$ty>() / 4)),*],
            };
        }

        const _: () = assert!(
            std::mem::size_of::<$name>() <= 4 * $crate::kernel::MAX_SLOTS,
            "kernel params exceed the 63 parameter slots"
        );
    };
}

#[cfg(test)]
mod tests {
    use super::KernelParams;

    crate::kernel_params! {
        struct ExampleTileParams { n: u32, scale: f32, shape: [u32; 6], last: u32 }
    }

    #[test]
    fn slot_constants_follow_the_struct_layout() {
        let wgsl = ExampleTileParams::LAYOUT.wgsl_slots();
        assert!(wgsl.contains("const EXAMPLE_TILE_N: u32 = 0u;"), "{wgsl}");
        assert!(
            wgsl.contains("const EXAMPLE_TILE_SCALE: u32 = 1u;"),
            "{wgsl}"
        );
        assert!(
            wgsl.contains("const EXAMPLE_TILE_SHAPE: u32 = 2u;"),
            "{wgsl}"
        );
        assert!(
            wgsl.contains("const EXAMPLE_TILE_LAST: u32 = 8u;"),
            "{wgsl}"
        );
        let p = ExampleTileParams {
            n: 7,
            scale: 0.5,
            shape: [1, 2, 3, 4, 5, 6],
            last: 9,
        };
        let slots: &[u32] = bytemuck::cast_slice(bytemuck::bytes_of(&p));
        assert_eq!(slots, [7, 0.5f32.to_bits(), 1, 2, 3, 4, 5, 6, 9]);
    }
}
