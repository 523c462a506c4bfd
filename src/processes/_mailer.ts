/** The mail provider the configuration picks. */
import type { Config } from "../config.ts";
import { createLogMailer } from "../mail/log_mailer.ts";
import type { Mailer } from "../mail/mailer.ts";
import { createResendMailer } from "../mail/resend_mailer.ts";

/** The configured mail provider. */
export function buildMailer(config: Config): Mailer {
  if (config.MAIL_PROVIDER === "log") return createLogMailer();
  return createResendMailer({
    apiKey: config.RESEND_API_KEY!,
    baseUrl: config.RESEND_BASE_URL,
    timeoutMs: config.MAIL_SEND_TIMEOUT_S * 1000,
  });
}
