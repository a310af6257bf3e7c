//! Nova's translation of its fault messages. nova-api renders a fault's
//! message in the language of the request's `Accept-Language` when it
//! has a translation for it (oslo.i18n's lazy messages, translated by
//! `Fault` for `req.best_match_language()`), English otherwise; the ids
//! a message names are its parameters and stay as they are.
//!
//! The simulator's translation is a pseudo-locale, the same for every
//! language it is told it has (`SimConfig::locales`): each word that is
//! not an id or a number is spelled backwards. It reads like nothing the
//! service knows in Nova's words, which is what a translation is to it.

use uuid::Uuid;

/// Nova's fault body, kept beside the rendered one so the layer around
/// the compute API can render it again in the request's language.
#[derive(Clone)]
pub(super) struct NovaFault(pub serde_json::Value);

impl NovaFault {
    /// `v` when it is Nova's fault shape for an error status: one key,
    /// Nova's name for the status, holding a `message` (keystonemiddleware's
    /// `{"error": ...}` is not Nova's, and is not translated).
    pub fn of(status: u16, v: &serde_json::Value) -> Option<Self> {
        let map = v.as_object().filter(|m| m.len() == 1 && status >= 400)?;
        let (name, inner) = map.iter().next()?;
        (name != "error" && inner.get("message").is_some_and(|m| m.is_string()))
            .then(|| NovaFault(v.clone()))
    }

    /// The same fault, its message translated.
    pub fn translated(mut self) -> serde_json::Value {
        if let Some(inner) = self.0.as_object_mut().and_then(|m| m.values_mut().next())
            && let Some(message) = inner.get("message").and_then(|m| m.as_str())
        {
            inner["message"] = serde_json::Value::String(translate(message));
        }
        self.0
    }
}

/// The language of `locales` that `accept_language` picks, as webob's
/// `best_match` does: the tags in order of their quality (`q`, 1 when not
/// given; 0 refuses), each matching a locale equal to it or to its
/// primary subtag (`de-DE` picks `de`). `None`: English.
pub(super) fn best_match(accept_language: &str, locales: &[String]) -> Option<String> {
    let mut asked: Vec<(f32, &str)> = accept_language
        .split(',')
        .filter_map(|item| {
            let mut parts = item.split(';');
            let tag = parts.next()?.trim();
            let q = parts
                .find_map(|p| p.trim().strip_prefix("q="))
                .map_or(Some(1.0), |q| q.trim().parse::<f32>().ok())?;
            (!tag.is_empty() && q > 0.0).then_some((q, tag))
        })
        .collect();
    // Stable: among equal qualities, the header's order.
    asked.sort_by(|a, b| b.0.total_cmp(&a.0));
    asked.iter().find_map(|(_, tag)| {
        let primary = tag.split('-').next().unwrap_or(tag);
        locales
            .iter()
            .find(|l| l.eq_ignore_ascii_case(tag) || l.eq_ignore_ascii_case(primary))
            .cloned()
    })
}

/// `message` in the pseudo-locale: every word but ids and numbers
/// spelled backwards.
pub(super) fn translate(message: &str) -> String {
    message
        .split(' ')
        .map(|word| {
            let bare = word.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-');
            if word.chars().any(|c| c.is_ascii_digit()) || Uuid::parse_str(bare).is_ok() {
                word.to_string()
            } else {
                word.chars().rev().collect()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_gets_the_best_language_nova_has_else_english() {
        let de = vec!["de".to_string()];
        assert_eq!(best_match("de-DE,de;q=0.9", &de).as_deref(), Some("de"));
        assert_eq!(best_match("fr, de;q=0.5", &de).as_deref(), Some("de"));
        assert_eq!(best_match("de;q=0, en", &de), None);
        assert_eq!(best_match("fr", &de), None);
        assert_eq!(best_match("de", &[]), None, "no translations: English");
    }

    #[test]
    fn a_translated_message_keeps_its_ids_and_numbers_and_no_english_word() {
        let v = Uuid::new_v4();
        let m = translate(&format!(
            "Invalid input received: Invalid volume: Volume {v} status must be available or downloading to reserve, but the current status is creating. (HTTP 400)"
        ));
        assert!(m.contains(&v.to_string()), "{m}");
        assert!(m.contains("400)"), "{m}");
        assert!(!m.contains("status must be available"), "{m}");
        let fault = serde_json::json!({"forbidden": {"code": 403, "message": "Policy doesn't allow x to be performed."}});
        let translated = NovaFault::of(403, &fault).unwrap().translated();
        assert_eq!(
            translated["forbidden"]["message"],
            "yciloP t'nseod wolla x ot eb .demrofrep"
        );
        assert_eq!(translated["forbidden"]["code"], 403);
        assert!(
            NovaFault::of(
                401,
                &serde_json::json!({"error": {"code": 401, "message": "m"}})
            )
            .is_none()
        );
    }
}
