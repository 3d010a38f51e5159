//! `#[derive(Module)]` for wgrad: writes a struct's `nn::Module` impl (its named parameters,
//! named buffers and train/eval switch) from its fields, so that a model's author writes only
//! `forward`, as an inherent method, and no field is ever left out of a list by hand.
//!
//! Re-exported as `wgrad::Module`; see its documentation for the field rules and an example.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::{
    parse_macro_input, spanned::Spanned, Data, DeriveInput, Fields, GenericArgument, PathArguments,
    Type,
};

/// Writes `impl wgrad::nn::Module` from the struct's fields (see `wgrad::Module`).
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match module_impl(&input) {
        Ok(tokens) => tokens.into(),
        Err(err) => err.to_compile_error().into(),
    }
}

/// What a field holds, read from its type's outer shape and its `#[module(..)]` attribute.
enum Holds {
    /// `Tensor`, `Option<Tensor>` or `Vec<Tensor>`: parameters (buffers with `buffer`).
    Tensors(Shape),
    /// Any other type: a child module (or an `Option` or `Vec` of them).
    Modules(Shape),
    /// `#[module(skip)]`: plain data (sizes, flags) the module does not register.
    Nothing,
}

/// The outer shape of a field's type.
#[derive(Clone, Copy)]
enum Shape {
    One,
    Optional,
    List,
}

/// One field as the generated code sees it.
struct Field {
    ident: syn::Ident,
    holds: Holds,
    /// `#[module(buffer)]`: tensors saved with the parameters but not trained.
    buffer: bool,
    /// `#[module(flatten)]`: the child's names without this field's name in front.
    flatten: bool,
}

fn module_impl(input: &DeriveInput) -> syn::Result<Tokens> {
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new(
            input.span(),
            "derive(Module) needs a struct with named fields",
        ));
    };
    let Fields::Named(named) = &data.fields else {
        return Err(syn::Error::new(
            data.fields.span(),
            "derive(Module) needs named fields: their names are the parameters' names",
        ));
    };
    let fields = named
        .named
        .iter()
        .map(read_field)
        .collect::<syn::Result<Vec<_>>>()?;

    let name = &input.ident;
    let (impl_generics, type_generics, where_clause) = input.generics.split_for_impl();
    // As PyTorch orders them: the struct's own tensors, then each child's, in field order.
    let (own, children): (Vec<&Field>, Vec<&Field>) = fields
        .iter()
        .partition(|f| matches!(f.holds, Holds::Tensors(_)));
    let in_order = || own.iter().chain(children.iter());
    let parameters = in_order().map(|f| named_tensors(f, false));
    let buffers = in_order().map(|f| named_tensors(f, true));
    let training = fields.iter().map(set_training);
    Ok(quote! {
        impl #impl_generics ::wgrad::nn::Module for #name #type_generics #where_clause {
            // The struct's own (inherent) `forward`; without one this would call itself, which
            // the lint below makes a compile error instead of a stack overflow.
            #[deny(unconditional_recursion)]
            fn forward(&self, x: &::wgrad::Tensor) -> ::wgrad::Result<::wgrad::Tensor> {
                Self::forward(self, x)
            }

            fn named_parameters(&self) -> ::std::vec::Vec<(::std::string::String, ::wgrad::Tensor)> {
                #[allow(unused_imports)]
                use ::wgrad::nn::Module as _;
                let mut named = ::std::vec::Vec::new();
                #(#parameters)*
                ::wgrad::nn::first_names(named)
            }

            fn named_buffers(&self) -> ::std::vec::Vec<(::std::string::String, ::wgrad::Tensor)> {
                #[allow(unused_imports)]
                use ::wgrad::nn::Module as _;
                let mut named = ::std::vec::Vec::new();
                #(#buffers)*
                ::wgrad::nn::first_names(named)
            }

            fn set_training(&self, training: bool) {
                #[allow(unused_imports)]
                use ::wgrad::nn::Module as _;
                let _ = training;
                #(#training)*
            }
        }
    })
}

/// Reads a field's `#[module(skip | buffer | flatten)]` and the shape of its type.
fn read_field(field: &syn::Field) -> syn::Result<Field> {
    let ident = field.ident.clone().expect("named fields have names");
    let (mut skip, mut buffer, mut flatten) = (false, false, false);
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                skip = true;
            } else if meta.path.is_ident("buffer") {
                buffer = true;
            } else if meta.path.is_ident("flatten") {
                flatten = true;
            } else {
                return Err(meta.error("expected `skip`, `buffer` or `flatten`"));
            }
            Ok(())
        })?;
    }
    let holds = if skip {
        Holds::Nothing
    } else {
        let (shape, inner) = outer_shape(&field.ty);
        if is_tensor(inner) {
            Holds::Tensors(shape)
        } else {
            Holds::Modules(shape)
        }
    };
    match holds {
        Holds::Modules(_) if buffer => Err(syn::Error::new(
            field.ty.span(),
            "#[module(buffer)] is for Tensor, Option<Tensor> or Vec<Tensor> fields",
        )),
        Holds::Tensors(_) if flatten => Err(syn::Error::new(
            field.ty.span(),
            "#[module(flatten)] is for child modules, not tensors",
        )),
        holds => Ok(Field {
            ident,
            holds,
            buffer,
            flatten,
        }),
    }
}

/// `Option<T>` and `Vec<T>` with their `T`; any other type as it is.
fn outer_shape(ty: &Type) -> (Shape, &Type) {
    if let Type::Path(path) = ty {
        if let Some(last) = path.path.segments.last() {
            if let PathArguments::AngleBracketed(args) = &last.arguments {
                if let (Some(GenericArgument::Type(inner)), 1) =
                    (args.args.first(), args.args.len())
                {
                    if last.ident == "Option" {
                        return (Shape::Optional, inner);
                    }
                    if last.ident == "Vec" {
                        return (Shape::List, inner);
                    }
                }
            }
        }
    }
    (Shape::One, ty)
}

/// `Tensor` (any path ending in it): a parameter or buffer, not a module.
fn is_tensor(ty: &Type) -> bool {
    matches!(ty, Type::Path(path)
        if path.path.segments.last().is_some_and(|s| s.ident == "Tensor" && s.arguments.is_empty()))
}

/// Pushes the field's parameters (`buffers` false) or buffers onto `named`.
fn named_tensors(field: &Field, buffers: bool) -> Tokens {
    let ident = &field.ident;
    let name = ident.to_string();
    match field.holds {
        Holds::Nothing => quote! {},
        Holds::Tensors(_) if field.buffer != buffers => quote! {},
        Holds::Tensors(Shape::One) => quote! {
            named.push((#name.to_string(), self.#ident.clone()));
        },
        Holds::Tensors(Shape::Optional) => quote! {
            if let Some(tensor) = &self.#ident {
                named.push((#name.to_string(), tensor.clone()));
            }
        },
        Holds::Tensors(Shape::List) => quote! {
            for (i, tensor) in self.#ident.iter().enumerate() {
                named.push((format!("{}.{}", #name, i), tensor.clone()));
            }
        },
        Holds::Modules(shape) => {
            let list = if buffers {
                format_ident!("named_buffers")
            } else {
                format_ident!("named_parameters")
            };
            let prefix = if field.flatten {
                quote! { ::std::string::String::new() }
            } else {
                quote! { format!("{}.", #name) }
            };
            let push = quote! {
                named.extend(child.#list().into_iter().map(|(n, t)| (format!("{}{}", prefix, n), t)));
            };
            match shape {
                Shape::One => quote! { { let child = &self.#ident; let prefix = #prefix; #push } },
                Shape::Optional => quote! {
                    if let Some(child) = &self.#ident { let prefix = #prefix; #push }
                },
                Shape::List => quote! {
                    for (i, child) in self.#ident.iter().enumerate() {
                        let prefix = format!("{}{}.", #prefix, i);
                        #push
                    }
                },
            }
        }
    }
}

/// Passes `set_training` on to the field's child modules.
fn set_training(field: &Field) -> Tokens {
    let ident = &field.ident;
    match field.holds {
        Holds::Modules(Shape::One) => quote! { self.#ident.set_training(training); },
        Holds::Modules(Shape::Optional) => quote! {
            if let Some(child) = &self.#ident { child.set_training(training); }
        },
        Holds::Modules(Shape::List) => quote! {
            for child in self.#ident.iter() { child.set_training(training); }
        },
        Holds::Tensors(_) | Holds::Nothing => quote! {},
    }
}
