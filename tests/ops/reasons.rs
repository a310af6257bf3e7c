//! Every reason the service can send is documented, from the one list in
//! the code (`src/domain/reason.rs`): docs/api.md's error table and the Go
//! client's constants (`clients/go/reasons.go`) are made from it here and
//! must be what is committed. `VR_BLESS=1 cargo test --test ops reasons`
//! writes them anew after the list changed.

use std::path::Path;

use volume_reconciler::domain::{ErrorCode, Reason, ReasonKind};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const BEGIN: &str = "<!-- reasons: made from src/domain/reason.rs by tests/ops/reasons.rs -->\n";
const END: &str = "<!-- reasons: end -->\n";

fn code_name(c: ErrorCode) -> &'static str {
    match c {
        ErrorCode::Cancelled => "CANCELLED",
        ErrorCode::InvalidArgument => "INVALID_ARGUMENT",
        ErrorCode::DeadlineExceeded => "DEADLINE_EXCEEDED",
        ErrorCode::NotFound => "NOT_FOUND",
        ErrorCode::PermissionDenied => "PERMISSION_DENIED",
        ErrorCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
        ErrorCode::FailedPrecondition => "FAILED_PRECONDITION",
        ErrorCode::Aborted => "ABORTED",
        ErrorCode::Internal => "INTERNAL",
        ErrorCode::Unavailable => "UNAVAILABLE",
        ErrorCode::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// What a keyed replay of the key meets, by kind (the last column).
fn replay(kind: ReasonKind) -> &'static str {
    match kind {
        ReasonKind::Decided => "the same answer (the key's decision)",
        ReasonKind::Retried => "a new operation under the key",
        ReasonKind::Open => "joins the operation",
        ReasonKind::Attempt => "(never the answer)",
        ReasonKind::Refused => "a call like the first (nothing recorded)",
    }
}

/// docs/api.md's error table: one row per reason, in the list's order.
fn table() -> String {
    let mut out = String::from(BEGIN);
    out.push_str(
        "| `ErrorInfo.reason` | code | when | what the caller does | a keyed replay then |\n",
    );
    out.push_str("|---|---|---|---|---|\n");
    for r in Reason::ALL {
        out.push_str(&format!(
            "| `{}` | `{}` | {} | {} | {} |\n",
            r.as_str(),
            code_name(r.code()),
            r.when(),
            r.then(),
            replay(r.kind())
        ));
    }
    out.push_str(END);
    out
}

/// `NOVA_TOO_MANY_DISKS` → `NovaTooManyDisks`.
fn camel(text: &str) -> String {
    text.split('_')
        .map(|w| {
            let lower = w.to_ascii_lowercase();
            let mut c = lower.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// The name of a code in grpc-go's `codes` package.
fn go_code(c: ErrorCode) -> &'static str {
    match c {
        ErrorCode::Cancelled => "Canceled",
        ErrorCode::InvalidArgument => "InvalidArgument",
        ErrorCode::DeadlineExceeded => "DeadlineExceeded",
        ErrorCode::NotFound => "NotFound",
        ErrorCode::PermissionDenied => "PermissionDenied",
        ErrorCode::ResourceExhausted => "ResourceExhausted",
        ErrorCode::FailedPrecondition => "FailedPrecondition",
        ErrorCode::Aborted => "Aborted",
        ErrorCode::Internal => "Internal",
        ErrorCode::Unavailable => "Unavailable",
        ErrorCode::Unauthenticated => "Unauthenticated",
    }
}

/// clients/go/reasons.go: one constant per reason, documented, and the
/// code the service answers each with.
fn go_source() -> String {
    let mut out = String::from(
        "// Code generated from src/domain/reason.rs by the service's tests; DO NOT EDIT.\n\n\
         package volumereconciler\n\n\
         import \"google.golang.org/grpc/codes\"\n\n\
         // The reasons the service sends in google.rpc.ErrorInfo.reason (Error.Reason)\n\
         // and in an operation's last_error, one constant each: compare with these,\n\
         // never with a message's text. docs/api.md's error table says what each\n\
         // means and what to do.\n\
         const (\n",
    );
    for (i, r) in Reason::ALL.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let name = format!("Reason{}", camel(r.as_str()));
        out.push_str(&format!(
            "\t// {name} ({}): {}.\n\t// The caller: {}.\n\t{name} = \"{}\"\n",
            code_name(r.code()),
            r.when(),
            r.then(),
            r.as_str()
        ));
    }
    out.push_str(")\n\n");
    out.push_str(
        "// reasonCodes is the code the service answers each reason with: what\n\
         // Wait answers a FAILED operation with, as AttachVolume does.\n\
         var reasonCodes = map[string]codes.Code{\n",
    );
    let width = Reason::ALL
        .iter()
        .map(|r| camel(r.as_str()).len() + "Reason".len() + 1)
        .max()
        .unwrap_or(0);
    for r in Reason::ALL {
        let key = format!("Reason{}:", camel(r.as_str()));
        out.push_str(&format!("\t{key:<width$} codes.{},\n", go_code(r.code())));
    }
    out.push_str("}\n");
    out
}

/// `path`'s text must be `want`; with `VR_BLESS=1` it is written so.
fn check(path: &Path, have: &str, want: &str, what: &str) {
    if have == want {
        return;
    }
    if std::env::var_os("VR_BLESS").is_some() {
        std::fs::write(path, want).unwrap();
        return;
    }
    panic!(
        "{} is not what src/domain/reason.rs makes of {what}: run `VR_BLESS=1 cargo test --test ops reasons` and commit the result",
        path.display()
    );
}

#[test]
fn the_api_docs_error_table_lists_every_reason_the_service_can_send() {
    let path = Path::new(ROOT).join("docs/api.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let start = doc
        .find(BEGIN)
        .expect("docs/api.md has the reasons table's opening marker");
    let end = doc[start..]
        .find(END)
        .map(|e| start + e + END.len())
        .expect("docs/api.md has the reasons table's closing marker");
    let want = format!("{}{}{}", &doc[..start], table(), &doc[end..]);
    check(&path, &doc, &want, "the error table");
    for r in Reason::ALL {
        assert!(
            want.contains(&format!("| `{}` |", r.as_str())),
            "{r} missing"
        );
    }
}

#[test]
fn the_go_clients_reason_constants_are_the_services_list() {
    let path = Path::new(ROOT).join("clients/go/reasons.go");
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    check(&path, &have, &go_source(), "the Go constants");
}

#[test]
fn camel_case_names_are_the_go_ones() {
    assert_eq!(camel("NOVA_TOO_MANY_DISKS"), "NovaTooManyDisks");
    assert_eq!(camel("OUTCOME_UNKNOWN"), "OutcomeUnknown");
}
